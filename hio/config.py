"""One way to configure every role: a TOML file, then environment, then flags.

Each role declares a frozen dataclass of settings. Its fields become command
line flags (``--queue-bytes``), environment variables (``HIO_MASTER_QUEUE_BYTES``
first, then ``HIO_QUEUE_BYTES``) and keys of the file's ``[master]`` section
(after the shared ``[cluster]`` section). Where a role listens (``listen``,
``lane_listen``, ``http_listen``, ...) is its own: neither ``[cluster]`` nor a
shared ``HIO_LISTEN`` may say it, since either would put every role that reads
it on one address. Later sources win: defaults <
file < environment < flags. Defaults run everything on one machine.

Example ``hio.toml``::

    [cluster]
    master_address = "master.example.org:7000"
    token_file = "/etc/hio/token"

    [worker]
    engines = ["hio/microscopy=4"]
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import math
import os
import re
import tomllib
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar, Protocol, TypeVar

from hio import commands


class _Dataclass(Protocol):
    __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]


C = TypeVar("C", bound=_Dataclass)

CONFIG_ENV = "HIO_CONFIG"
FSYNC_POLICIES = ("always", "batch", "never")  # when a durable store's bytes reach the disk


class ConfigError(ValueError):
    """A setting has a value that cannot be used; the message names it."""


def setting(default: Any, help_text: str, *, factory: Any = None) -> Any:
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata={"help": help_text})
    return dataclasses.field(default=default, metadata={"help": help_text})


def role_local(name: str) -> bool:
    """Whether a setting says where a role listens: set per role, never shared by all."""
    return name.endswith("listen")


def _env_names(role: str, name: str) -> list[str]:
    """The variables a role reads a setting from, first wins (a role-local one only its own)."""
    own = f"HIO_{role.upper()}_{name.upper()}"
    return [own] if role_local(name) else [own, f"HIO_{name.upper()}"]


def _refuse_shared_listen(role: str, names: set[str]) -> None:
    """A ``HIO_LISTEN`` (or any shared ``HIO_<X>_LISTEN``) would reach every role: name it."""
    for name in sorted(n for n in names if role_local(n)):
        shared = f"HIO_{name.upper()}"
        if shared in os.environ:
            raise ConfigError(
                f"environment {shared}: where a role listens is set per role "
                f"(HIO_{role.upper()}_{name.upper()} for {role}); a shared {shared} would put every "
                "role started from this environment on the same address"
            )


def _convert(value: Any, typ: Any, where: str) -> Any:
    """Turn a string (env/flag) or TOML value into the field's type."""
    origin = typing.get_origin(typ)
    try:
        if typ is bool:
            if isinstance(value, bool):
                return value
            text = str(value).strip().lower()
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off", ""):
                return False
            raise ValueError(f"not a boolean: {value!r}")
        if typ is int:
            if isinstance(value, bool):
                raise ValueError("not an integer")
            try:
                return int(scaled(value)) if isinstance(value, str) else int(value)
            except ValueError:
                raise ValueError(f"{value!r} is not an integer") from None
        if typ is float:
            try:
                return float(value)
            except ValueError:
                raise ValueError(f"{value!r} is not a number") from None
        if typ is str:
            return str(value)
        if origin is tuple:
            items = value if isinstance(value, (list, tuple)) else [v for v in str(value).split(",") if v.strip()]
            return tuple(str(v).strip() for v in items)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: {exc}") from None
    raise ConfigError(f"{where}: unsupported setting type {typ!r}")


_UNITS = {"k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4}


def scaled(text: str) -> int:
    """Parse sizes like '64M', '1g', '512k' (binary units) or plain integers."""
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    if t and t[-1] in _UNITS:
        return int(float(t[:-1]) * _UNITS[t[-1]])
    return int(t)


def flag_items(given: list[Any]) -> list[str]:
    """The items of a repeatable flag: each value given, split at commas (``--sizes 1M,10M``)."""
    return [v.strip() for item in given for v in str(item).split(",") if v.strip()]


def size_setting(name: str, text: str) -> int:
    """A setting's size (:func:`scaled`); ConfigError naming the setting when ``text`` is none."""
    try:
        return scaled(str(text))
    except ValueError:
        raise ConfigError(f"{name}: cannot read {text!r} as a size (examples: 512K, 64M, 1G)") from None


def add_arguments(parser: argparse.ArgumentParser, cls: type, role: str) -> None:
    """Add one flag per field of ``cls``; the help shows the environment fallback."""
    parser.add_argument("--config", default=None, help=f"TOML configuration file (env {CONFIG_ENV})")
    types = typing.get_type_hints(cls)
    # accepted, not in --help (a client's server-only settings)
    unlisted: frozenset[str] = getattr(cls, "UNLISTED", frozenset())
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        typ = types[f.name]
        default = f.default_factory() if callable(f.default_factory) else f.default
        help_text = f"{f.metadata.get('help', '')} [default: {default!r}; env {_env_names(role, f.name)[0]}]"
        help_text = help_text.replace("%", "%%")  # argparse formats help with %
        if f.name in unlisted:
            help_text = argparse.SUPPRESS
        if typ is bool:
            parser.add_argument(flag, dest=f.name, default=None, action=argparse.BooleanOptionalAction, help=help_text)
        elif typing.get_origin(typ) is tuple:
            parser.add_argument(flag, dest=f.name, default=None, action="append", help=help_text + " (repeatable)")
        else:
            parser.add_argument(flag, dest=f.name, default=None, help=help_text)


def load_file(path: str | os.PathLike[str] | None) -> dict[str, Any]:
    """Read the TOML file named by ``path`` or ``$HIO_CONFIG``; {} if neither."""
    path = path or os.environ.get(CONFIG_ENV)
    if not path:
        return {}
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"configuration file not found: {path}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"configuration file {path} is not valid TOML: {exc}") from None


@dataclasses.dataclass(frozen=True)
class PassedOn:
    """Settings a role passes on to another it starts, as ``NAME=VALUE`` items of one of its
    own settings: the worker's ``engine_settings`` for its engines, which start with a clean
    environment and read no file. Declared on the role's config as ``PASSED_ON``.

    Each source is passed in the precedence it has for any setting, lowest first: the
    file's ``[cluster]`` table (only the other role's own settings: a ``[cluster]`` value
    reaches every role that has the setting), the other role's table (``[engine]``), the items of ``field``
    in the file, ``HIO_<NAME>`` then ``HIO_ENGINE_<NAME>`` variables, then the items of
    ``field`` from the environment or a flag. Variables this role reads itself (the
    worker's ``HIO_ENGINE_LISTEN_HOST`` is its ``engine_listen_host``) are not passed on.
    """

    section: str  # the other role's table and variable prefix: engine
    field: str  # the setting carrying the items: engine_settings
    own_names: Callable[[], frozenset[str]]  # the other role's settings this role lacks

    def items(
        self, role: str, names: set[str], file_data: dict[str, Any], *, in_file: tuple[str, ...], given: tuple[str, ...]
    ) -> tuple[str, ...]:
        """All the items, lowest precedence first: ``in_file`` is ``field`` as the file set it,
        ``given`` as the environment or a flag set it (which then replaced the file's)."""
        table = file_data.get(self.section, {})
        if not isinstance(table, dict):
            raise ConfigError(f"[{self.section}] in the configuration file must be a table")
        theirs = self.own_names()  # not this role's settings, so HIO_<NAME> of theirs is not ours
        ours = {env for name in names for env in _env_names(role, name)}
        prefix = f"HIO_{self.section.upper()}_"
        generic = tuple(
            f"{name}={os.environ[f'HIO_{name.upper()}']}"
            for name in sorted(theirs)
            if f"HIO_{name.upper()}" in os.environ and not role_local(name)
        )
        prefixed = tuple(
            f"{key[len(prefix) :].lower()}={value}"
            for key, value in sorted(os.environ.items())
            if key.startswith(prefix) and len(key) > len(prefix) and key not in ours
        )
        return (
            tuple(f"{key}={as_text(value)}" for key, value in file_data.get("cluster", {}).items() if key in theirs)
            + tuple(f"{key}={as_text(value)}" for key, value in table.items())
            + in_file
            + generic
            + prefixed
            + given
        )


def build(
    cls: type[C],
    role: str,
    args: argparse.Namespace | None = None,
    overrides: dict[str, Any] | None = None,
    file_data: dict[str, Any] | None = None,
) -> C:
    """Build the frozen config of ``role`` from defaults, file, env, flags, overrides."""
    types = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    if file_data is None:
        file_data = load_file(getattr(args, "config", None) if args else None)
    values: dict[str, Any] = {}
    for section in ("cluster", role):
        table = file_data.get(section, {})
        if not isinstance(table, dict):
            raise ConfigError(f"[{section}] in the configuration file must be a table")
        for key, value in table.items():
            if section == "cluster" and role_local(key):
                raise ConfigError(
                    f"[cluster] {key}: where a role listens belongs in that role's table ([master], "
                    "[repository], ...); in [cluster] it would put every role that reads this file "
                    "on the same address"
                )
            if key in names:
                values[key] = _convert(value, types[key], f"[{section}] {key}")
            elif section == role:
                raise ConfigError(f"unknown setting '{key}' in [{section}]; known: {', '.join(sorted(names))}")
            elif key not in commands.cluster_setting_names():
                raise ConfigError(
                    f"unknown setting '{key}' in [cluster]: no role has it "
                    "(hio <role> --help lists each role's settings)"
                )
    passed: PassedOn | None = getattr(cls, "PASSED_ON", None)  # the worker's settings for its engines
    in_file = tuple(values.pop(passed.field, ())) if passed else ()  # what follows tells if it is replaced
    _refuse_shared_listen(role, names)
    for name in names:
        for env in _env_names(role, name):
            if env in os.environ:
                values[name] = _convert(os.environ[env], types[name], f"environment {env}")
                break
    if args is not None:
        for name in names:
            value = getattr(args, name, None)
            if value is not None:
                if isinstance(value, list) and typing.get_origin(types[name]) is tuple:
                    value = flag_items(value)
                values[name] = _convert(value, types[name], "--" + name.replace("_", "-"))
    if passed:
        given: tuple[Any, ...] = ()
        if passed.field in values:  # set by the environment or a flag: it replaces the file's, as any setting
            given, in_file = tuple(values[passed.field]), ()
        values[passed.field] = passed.items(role, names, file_data, in_file=in_file, given=given)
    for name, value in (overrides or {}).items():
        if name not in names:
            raise ConfigError(f"unknown setting '{name}' for {role}")
        values[name] = value
    config = cls(**values)
    if "log_level" in names:  # every command's: one check, not one per config class
        one_of("log_level", str(typing.cast(Any, config).log_level).lower(), LOG_LEVELS)
    validate = getattr(config, "validate", None)
    if callable(validate):
        validate()
    return config


def as_text(value: Any) -> str:
    """A setting's value (TOML or converted) as an environment variable would say it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value))
    return str(value)


def parse_assignments(items: tuple[str, ...], cls: type, where: str, *, refused: dict[str, str]) -> dict[str, Any]:
    """``NAME=VALUE`` items checked against the settings of ``cls``, each converted to its
    field's type; a name in ``refused`` is refused with its reason. Later items win."""
    hints = typing.get_type_hints(cls)
    types = {f.name: hints[f.name] for f in dataclasses.fields(cls)}  # not class variables (PASSED_ON)
    out: dict[str, Any] = {}
    for item in items:
        name, sep, value = item.partition("=")
        name = name.strip().replace("-", "_")
        if not sep or not name:
            raise ConfigError(f"{where}: {item!r} must look like NAME=VALUE")
        if name in refused:
            raise ConfigError(f"{where}: {name}: {refused[name]}")
        if name not in types:
            known = sorted(set(types) - set(refused))
            raise ConfigError(f"{where}: unknown setting '{name}'; known: {', '.join(known)}")
        out[name] = _convert(value.strip(), types[name], f"{where} {name}")
    return out


_ADDRESS = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]*):(\d{1,5})$")


def check_address(name: str, value: str, *, allow_empty: bool = False) -> None:
    """Refuse a listen or peer address that is not host:port ('[v6]:port', ':port' = all
    interfaces), so a typo is named at start-up rather than failing a bind or a connect."""
    if allow_empty and value == "":
        return
    match = _ADDRESS.match(value)
    if match is None or int(match.group(2)) > 65535:
        raise ConfigError(f"{name} must be host:port, got {value!r}")


def split_address(address: str) -> tuple[str, int]:
    """('host', port) of 'host:port' or '[v6]:port'."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"lane address must be host:port, got {address!r}")
    return host.strip("[]"), int(port)


def local_host(listen_host: str) -> str:
    """The address this machine reaches a server on, given the host it listens on."""
    return "127.0.0.1" if listen_host in ("", "0.0.0.0", "::", "[::]") else listen_host


def lane_beside(address: str, port: int) -> str:
    """The lane at ``port`` on the host of ``address`` (how a sender reaches a server's lane
    when the server names only its port: the host is the one the sender reached it at)."""
    return f"{address.rpartition(':')[0]}:{port}"


def same_port(a: str, b: str) -> bool:
    """Whether two listen addresses would bind the same port (one port, and one host or a
    wildcard on either side); port 0 is any free port, never the same."""
    (host_a, port_a), (host_b, port_b) = split_address(a), split_address(b)
    wildcard = ("", "0.0.0.0", "::")
    return port_a == port_b != 0 and (host_a == host_b or host_a in wildcard or host_b in wildcard)


def lane_listen_address(listen: str, lane_listen: str, *, offered: bool) -> str:
    """Where a server's lane listens: ``lane_listen``, else ``listen``'s host and port + 1
    (any free port when ``listen``'s port is 0; a ConfigError when there is no port + 1);
    '' when it offers none (``offered`` false)."""
    if not offered:
        return ""
    if lane_listen:
        return lane_listen
    port = split_address(listen)[1]
    if port == 65535:
        raise ConfigError("listen's port is 65535, so the lane has no port + 1: set lane_listen")
    return lane_beside(listen, port + 1 if port else 0)


# gRPC target schemes a peer address may use instead of host:port
_TARGET_SCHEMES = ("dns:", "unix:", "unix-abstract:", "ipv4:", "ipv6:", "vsock:")


def check_peer(name: str, value: str) -> None:
    """Refuse a peer address without a port: gRPC would quietly try port 443. A gRPC
    target with a scheme (``dns:///host:port``, ``unix:/path``) is taken as it is."""
    if value.startswith(_TARGET_SCHEMES):
        return
    check_address(name, value)
    if value.startswith(":"):
        raise ConfigError(f"{name} must name a host, got {value!r} (e.g. 127.0.0.1{value})")


def only_this_host(address: str) -> bool:
    """Whether a peer address means whatever host uses it: loopback, any address, a local
    socket. Such an address handed to another host (a worker server, a Spark executor)
    names that host, not this one."""
    if address.startswith(("unix:", "unix-abstract:", "vsock:")):
        return True
    if address.startswith(("ipv4:", "ipv6:")):
        address = address.partition(":")[2]
    host = address.rsplit("/", 1)[-1].rpartition(":")[0].strip("[]").lower()
    if host in ("", "localhost") or host.endswith(".localhost"):
        return True
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    return ip.is_loopback or ip.is_unspecified


def positive(name: str, value: float) -> None:
    if not value > 0:  # NaN too
        raise ConfigError(f"{name} must be positive, got {value}")


def between(name: str, value: float, low: float, high: float = math.inf, unit: str = "") -> None:
    """Refuse a value outside ``low``..``high`` (NaN too), naming the setting; ``unit`` follows the bounds."""
    if not low <= value <= high:
        shown = [f"{bound:,}" if isinstance(bound, int) else f"{bound:g}" for bound in (low, high)]
        bounds = f"at least {shown[0]}" if high == math.inf else f"between {shown[0]} and {shown[1]}"
        raise ConfigError(f"{name} must be {bounds}{unit}, got {value}")


def one_of(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{name} must be one of {', '.join(choices)}, got {value!r}")


LOG_LEVELS = ("debug", "info", "warning", "error")


def state_dir(base: str, role: str) -> Path:
    """The folder where ``role`` keeps its files under the data directory."""
    return make_folder("data_dir", Path(base).expanduser() / role)


def make_folder(name: str, path: Path) -> Path:
    """``path``, made if missing, for the setting ``name``; ConfigError naming the setting
    when it cannot be made or written (a data folder on a path that does not exist, or
    another user's), not an OSError from the first file a role writes."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"{name}: cannot create {path}: {exc.strerror or exc}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"{name}: {path} is not writable by this user")
    return path
