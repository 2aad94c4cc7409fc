"""Settings every role shares: where the other roles are, credentials, TLS,
wire bounds. Role configs inherit from :class:`ClusterSettings`."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from hio.config import ConfigError, check_peer, setting

MiB = 1024 * 1024
GiB = 1024 * MiB
# The repository's default bound on one feature record decompressed; an engine refuses
# features over it before compressing them (the repository would refuse the record).
FEATURE_RECORD_DECOMPRESSED_BYTES = 64 * MiB
# Bytes of a PutFeatures or ReadFeatures message beyond the one feature record it carries.
RECORD_HEADROOM = 64 * 1024
#: The images hio's own pipelines process (``hio.worker.pipelines``): a master always accepts them.
BUILTIN_IMAGES = ("hio/microscopy", "hio/simulation", "hio/synthetic")


#: Settings only a server uses: a command that only calls roles (hio status, hio send)
#: accepts them (one configuration file serves every role) but does not list them in --help.
SERVER_SETTINGS = frozenset({"tokens_file", "tls_client_auth", "ticket_key_file", "stream_idle_seconds", "metrics"})


@dataclasses.dataclass(frozen=True)
class ClusterSettings:
    master_address: str = setting("127.0.0.1:7000", "host:port of the master")
    repository_address: str = setting("127.0.0.1:7100", "host:port of the repository")
    data_dir: str = setting("./var", "folder for this role's durable state")
    token: str = setting("", "token this process presents to other roles")
    token_file: str = setting("", "file holding the token to present (preferred over --token)")
    tokens_file: str = setting(
        "", "server side: file of accepted tokens, one 'token role name' a line; empty = no authentication"
    )
    tls_cert: str = setting(
        "", "PEM certificate this process presents: a server's, or a client's for mutual TLS (enables TLS)"
    )
    tls_key: str = setting("", "PEM private key for --tls-cert")
    tls_ca: str = setting("", "PEM CA bundle to verify peers (clients: servers; servers: client certs for mutual TLS)")
    tls_client_auth: bool = setting(False, "servers: require client certificates signed by --tls-ca (mutual TLS)")
    ticket_key_file: str = setting(
        "", "secret key (file) the master signs routed tuple ids with and engines check; empty = off"
    )
    stream_idle_seconds: float = setting(
        30.0,
        "end an incoming tuple stream whose sender sends nothing for this "
        "long (frees the channel, queue or spool room it held); 0 = never",
    )
    chunk_bytes: int = setting(1 * MiB, "bytes per chunk when streaming tuples")
    max_tuple_bytes: int = setting(256 * MiB, "largest tuple accepted anywhere")
    log_level: str = setting("warning", "debug, info, warning (also one line when a role is ready) or error")
    log_json: bool = setting(False, "log one JSON object per line")
    metrics: bool = setting(
        True,
        "measure and serve Prometheus metrics at /metrics of the role's http_listen "
        "(docs/monitoring.md); off = nothing measured on the data path, /metrics answers 404",
    )

    @property
    def speaks_tls(self) -> bool:
        """This process's gRPC connections use TLS; its payload lanes then do too
        (``hio.transport.lanetls``)."""
        return bool(self.tls_ca or self.tls_cert)

    def presented_token(self) -> str:
        """The token this process sends, from --token-file or --token."""
        if self.token_file:
            try:
                return Path(self.token_file).expanduser().read_text().strip()
            except OSError as exc:
                raise ConfigError(f"cannot read token file {self.token_file}: {exc.strerror}") from None
        return self.token or os.environ.get("HIO_TOKEN", "")

    def validate_cluster(self) -> None:
        check_peer("master_address", self.master_address)
        check_peer("repository_address", self.repository_address)
        if self.chunk_bytes < 1024 or self.chunk_bytes > 64 * MiB:
            raise ConfigError(f"chunk_bytes must be between 1 KiB and 64 MiB, got {self.chunk_bytes}")
        if self.max_tuple_bytes < 1:
            raise ConfigError("max_tuple_bytes must be positive")
        if not self.stream_idle_seconds >= 0:  # NaN too
            raise ConfigError(f"stream_idle_seconds must be 0 (never) or positive, got {self.stream_idle_seconds}")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ConfigError("tls_cert and tls_key go together")
        if self.tls_client_auth and not self.tls_ca:
            raise ConfigError("tls_client_auth needs tls_ca to verify client certificates")

    def validate_serving(self) -> None:
        """For roles that serve gRPC (master, repository, worker): TLS for their clients
        means a certificate of their own. With tls_ca alone they would serve plaintext
        while speaking TLS to each other, and every connection would fail its handshake."""
        if self.tls_ca and not self.tls_cert:
            raise ConfigError(
                "tls_ca is set without tls_cert and tls_key: this role serves gRPC, and would "
                "serve it in plaintext to peers that speak TLS; give it a certificate "
                "(`hio certs`), or drop tls_ca"
            )

    def validate(self) -> None:
        self.validate_cluster()


def settings_flags(settings: ClusterSettings, *, omit: tuple[str, ...]) -> list[str]:
    """Flags for every shared setting that differs from its default, but those in ``omit``
    (each caller gives its own addresses, data folder, token): a child process started
    with them speaks as its parent does."""
    args: list[str] = []
    for field in dataclasses.fields(ClusterSettings):
        value = getattr(settings, field.name)
        if field.name in omit or value == field.default:
            continue
        flag = "--" + field.name.replace("_", "-")
        if isinstance(value, bool):
            args.append(flag if value else "--no-" + flag[2:])
        else:
            args += [flag, str(value)]
    return args


def message_limit(settings: ClusterSettings) -> int:
    """Largest gRPC message: one chunk plus headroom, never less than 16 MiB."""
    return max(settings.chunk_bytes + 4 * MiB, 16 * MiB)


def record_limit(settings: ClusterSettings) -> int:
    """Largest feature record one message carries: what an engine may put, what the
    repository accepts and what it can read back."""
    return message_limit(settings) - RECORD_HEADROOM
