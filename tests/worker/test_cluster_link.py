"""The engine's link to the master and the repository: its errors name what to fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from hio.settings import ClusterSettings
from hio.transport import errors
from hio.transport.certs import generate
from hio.worker.cluster import ClusterLink
from tests.common.test_net import echo_server


def test_a_pull_refused_for_want_of_a_client_certificate_says_so(tmp_path: Path) -> None:
    """The long-poll is the call an idle engine makes most: when TLS is set up
    wrong, its error must carry the same advice as the unary calls, which
    depends on whether this engine speaks TLS (it does here, without a
    certificate of its own, to a master that requires one)."""
    certs = generate(tmp_path / "certs", ("server",), ("127.0.0.1",))
    server, address = echo_server(
        ClusterSettings(
            tls_cert=str(certs["server"]),
            tls_key=str(certs["server-key"]),
            tls_ca=str(certs["ca"]),
            tls_client_auth=True,
        )
    )
    link = ClusterLink(
        ClusterSettings(master_address=address, repository_address=address, tls_ca=str(certs["ca"])), rpc_deadline=5.0
    )
    try:
        call = link.pull("c1", wait_seconds=0.5)
        with pytest.raises(errors.Unavailable) as err:
            list(call.frames())
        assert str(err.value).startswith("master: UNAVAILABLE")
        assert "it may require a client certificate" in str(err.value), str(err.value)
    finally:
        link.close()
        server.stop(0)
