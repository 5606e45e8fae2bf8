"""Every private name of torch unifit uses (unifit/strategies/torch_compat.py), checked on the installed torch: a
release that moves one fails here, by name, before a strategy fails in a run."""

from __future__ import annotations

import inspect

import torch

from unifit.strategies import torch_compat as compat


def test_pytree_and_flat_buffers_round_trip():
    tree = {"a": torch.arange(3.0), "b": [torch.ones(2, 2), 5]}
    leaves, spec = compat.tree_flatten(tree)
    assert compat.tree_unflatten(leaves, spec)["b"][1] == 5
    doubled = compat.tree_map_only(torch.Tensor, lambda t: t * 2, tree)
    assert torch.equal(doubled["a"], torch.arange(3.0) * 2) and compat.tree_map(lambda x: x, 3) == 3
    tensors = [torch.arange(4.0).view(2, 2), torch.tensor([7.0])]
    flat = compat.flatten_dense(tensors)
    assert flat.tolist() == [0.0, 1.0, 2.0, 3.0, 7.0]
    assert [t.tolist() for t in compat.unflatten_dense(flat, tensors)] == [t.tolist() for t in tensors]


def test_views_and_in_place_changes_are_told():
    base = torch.zeros(4, requires_grad=True) * 1
    view = base[:2]
    assert compat.is_view(view) and not compat.is_view(base)
    before = compat.version_counter(view)
    view.add_(1)
    assert compat.version_counter(view) > before


def test_rnn_weights_follow_replaced_parameters():
    lstm = torch.nn.LSTM(3, 4)
    replaced = torch.nn.Parameter(torch.zeros_like(lstm.weight_ih_l0))
    lstm.register_parameter("weight_ih_l0", replaced)
    compat.refresh_rnn_weights(lstm)
    assert lstm(torch.ones(2, 1, 3))[0].shape == (2, 1, 4)
    assert any(w is replaced for w in lstm._flat_weights)


def test_a_schedulers_last_lr_is_set():
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    compat.set_last_lr(scheduler, [0.5])
    assert scheduler.get_last_lr() == [0.5]


def test_distributed_checkpoint_on_fsspec_reads_back_whole(tmp_path):
    import torch.distributed.checkpoint as dcp

    state = {"model": {"w": torch.arange(6.0).view(2, 3)}, "step": torch.tensor(4)}
    dcp.save(state, storage_writer=compat.fsspec_writer(str(tmp_path / "ckpt")), no_dist=True)
    whole = compat.load_whole(str(tmp_path / "ckpt"))
    assert torch.equal(whole["model"]["w"], state["model"]["w"]) and int(whole["step"]) == 4
    into = {"model": {"w": torch.zeros(2, 3)}, "step": torch.tensor(0)}
    dcp.load(into, storage_reader=compat.fsspec_reader(str(tmp_path / "ckpt")), no_dist=True)
    assert torch.equal(into["model"]["w"], state["model"]["w"])


def test_fsdp2_and_pipelining_internals_are_where_unifit_reaches_them():
    """What needs a process group to make is checked on the classes: the names torch_compat reads or sets."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState
    from torch.distributed.pipelining import schedules, stage

    assert callable(FSDPModule._get_fsdp_state)
    state_init = inspect.getsource(FSDPState.__init__)
    assert "_fsdp_param_groups" in state_init or "_fsdp_param_group" in state_init
    group_init = inspect.getsource(FSDPParamGroup.__init__)
    assert "self.fsdp_params" in group_init and "post_forward_mesh_info" in group_init
    assert callable(FSDPParamGroup._init_mp_dtypes)
    assert "_has_backward" in inspect.getsource(schedules._PipelineSchedule.__init__)
    assert callable(schedules.PipelineScheduleSingle._initialize_stage)
    stage_source = inspect.getsource(stage.PipelineStage)
    for name in ("_fwd_outputs_for_bwd_meta", "_fwd_inputs_for_bwd_meta", "_fwd_kwargs_tensors_for_bwd_meta"):
        assert name in stage_source, name
    assert "_post_metadata_inference_cleanup" in stage_source
    assert compat.RECEIVED_ACTIVATIONS_NEED_GRAD == (torch.__version__ < "2.13")
    assert not compat.TORCH < "2.4"  # a version comparison, not a string one ("2.13" < "2.4" as strings)


def test_a_checkpoint_wrapped_block_keeps_its_names_in_the_state_dict():
    block = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    model = torch.nn.Sequential(block, torch.nn.Linear(4, 1))
    keys = list(model.state_dict())
    model[0] = compat.checkpoint_wrapped(block, None)
    assert compat.is_checkpoint_wrapped(model[0]) and compat.inner_module(model[0]) is block
    assert list(model.state_dict()) == keys
    (name, _), *_ = model.named_parameters()
    assert name != "0.0.weight" and compat.unwrapped_name(name) == "0.0.weight"
    x = torch.randn(3, 4)
    model(x).sum().backward()  # runs through torch.utils.checkpoint
    assert block[0].weight.grad is not None


def test_the_count_of_compiled_graphs_grows_with_a_compile():
    before = compat.compiled_graphs()
    double = torch.compile(lambda x: x * 2 + 1)
    assert torch.equal(double(torch.ones(3)), torch.full((3,), 3.0))
    assert compat.compiled_graphs() == before + 1
