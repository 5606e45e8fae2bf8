"""The one dispatcher that calls callbacks for an Event (Keras' CallbackList, for unifit's events)."""

from __future__ import annotations

from typing import Any, Callable, Sequence

from unifit.loop.callback import Callback
from unifit.loop.events import Event


class Dispatcher:
    """Calls callbacks in list order; only callbacks that override a hook are called for it."""

    def __init__(self, callbacks: Sequence[Callback], context: Any) -> None:
        self.context = context
        self._handlers: dict[Event, list[Callable[..., None]]] = {
            event: [
                getattr(cb, event.value)
                for cb in callbacks
                if getattr(type(cb), event.value) is not getattr(Callback, event.value)
            ]
            for event in Event
        }

    def handlers(self, event: Event) -> list[Callable[..., None]]:
        """The bound hooks for `event` (the loop fetches per-step ones once per epoch)."""
        return self._handlers[event]

    def __call__(self, event: Event, *args: Any) -> None:
        for hook in self._handlers[event]:
            hook(self.context, *args)
