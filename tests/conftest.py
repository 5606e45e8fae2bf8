"""Shared fixtures: a real S3 endpoint over HTTP on 127.0.0.1 (moto's server mode)."""

from __future__ import annotations

import os
import uuid

import pytest

FAKE_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "unifit-test",
    "AWS_SECRET_ACCESS_KEY": "unifit-test-secret",
    "AWS_DEFAULT_REGION": "us-east-1",
}


class S3Endpoint:
    """A moto S3 server that tests can stop and start again on the same port (state is kept)."""

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        self._server_cls = ThreadedMotoServer
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.server.start()
        self.port = self.server.get_host_and_port()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {**FAKE_CREDENTIALS, "AWS_ENDPOINT_URL_S3": self.url}

    def stop(self) -> None:
        self.server.stop()

    def start(self) -> None:
        self.server = self._server_cls(ip_address="127.0.0.1", port=self.port, verbose=False)
        self.server.start()

    def fs(self):
        import s3fs

        return s3fs.S3FileSystem(
            key=FAKE_CREDENTIALS["AWS_ACCESS_KEY_ID"],
            secret=FAKE_CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
            endpoint_url=self.url,
        )


@pytest.fixture(scope="session")
def s3_endpoint():
    os.environ.update(FAKE_CREDENTIALS)
    endpoint = S3Endpoint()
    os.environ["AWS_ENDPOINT_URL_S3"] = endpoint.url
    yield endpoint
    endpoint.stop()


@pytest.fixture
def bucket(s3_endpoint) -> str:
    """A fresh bucket name, created on the endpoint."""
    name = f"unifit-{uuid.uuid4().hex[:10]}"
    s3_endpoint.fs().mkdir(name)
    return name
