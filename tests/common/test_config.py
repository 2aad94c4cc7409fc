import argparse
import dataclasses
import os
import re

import pytest

from hio import config as cfg
from hio.settings import ClusterSettings


@dataclasses.dataclass(frozen=True)
class DemoConfig(ClusterSettings):
    listen: str = cfg.setting("127.0.0.1:1", "where")
    queue_bytes: int = cfg.setting(10, "bound")
    ratio: float = cfg.setting(0.5, "ratio")
    fast: bool = cfg.setting(False, "flag")
    engines: tuple[str, ...] = cfg.setting(None, "list", factory=lambda: ("a",))

    def validate(self) -> None:
        self.validate_cluster()
        cfg.positive("queue_bytes", self.queue_bytes)


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cfg.add_arguments(parser, DemoConfig, "demo")
    return parser.parse_args(argv)


def test_defaults_run_on_one_machine() -> None:
    c = cfg.build(DemoConfig, "demo", parse([]))
    assert c.listen == "127.0.0.1:1" and c.master_address == "127.0.0.1:7000" and c.engines == ("a",)


def test_precedence_file_then_env_then_flags(tmp_path, monkeypatch) -> None:
    path = tmp_path / "hio.toml"
    path.write_text(
        '[cluster]\nmaster_address = "m:1"\nchunk_bytes = 2048\n'
        '[demo]\nqueue_bytes = 20\nratio = 0.25\nengines = ["x=2", "y"]\n'
    )
    monkeypatch.setenv("HIO_DEMO_QUEUE_BYTES", "30")
    monkeypatch.setenv("HIO_FAST", "yes")
    c = cfg.build(DemoConfig, "demo", parse(["--config", str(path), "--ratio", "0.75"]))
    assert c.master_address == "m:1" and c.chunk_bytes == 2048
    assert c.queue_bytes == 30, "role-prefixed environment beats the file"
    assert c.ratio == 0.75, "flags beat everything"
    assert c.fast is True and c.engines == ("x=2", "y")


def test_sizes_with_units_and_repeatable_lists(monkeypatch) -> None:
    monkeypatch.setenv("HIO_QUEUE_BYTES", "64M")
    c = cfg.build(DemoConfig, "demo", parse(["--engines", "a=1", "--engines", "b,c"]))
    assert c.queue_bytes == 64 * 1024 * 1024 and c.engines == ("a=1", "b", "c")


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--queue-bytes", "lots"], "--queue-bytes"),
        (["--queue-bytes", "0"], "queue_bytes must be positive"),
        (["--chunk-bytes", "10"], "chunk_bytes"),
        (["--tls-cert", "x.pem"], "tls_cert and tls_key"),
    ],
)
def test_bad_values_name_the_setting(argv, message) -> None:
    with pytest.raises(cfg.ConfigError, match=message):
        cfg.build(DemoConfig, "demo", parse(argv))


def test_unknown_key_in_the_role_section_is_refused(tmp_path) -> None:
    path = tmp_path / "hio.toml"
    path.write_text("[demo]\nqueue_byte = 1\n")
    with pytest.raises(cfg.ConfigError, match="unknown setting 'queue_byte'"):
        cfg.build(DemoConfig, "demo", parse(["--config", str(path)]))


@pytest.mark.parametrize("key", ["listen", "lane_listen", "http_listen", "ingest_listen"])
def test_where_a_role_listens_is_refused_in_the_cluster_table(tmp_path, key) -> None:
    """Every role reads [cluster]: a listen address there would send the master and the
    repository on one host to the same port; the error says where it belongs."""
    path = tmp_path / "hio.toml"
    path.write_text(f'[cluster]\n{key} = "0.0.0.0:7000"\n')
    with pytest.raises(cfg.ConfigError, match=rf"\[cluster\] {key}: .*belongs in that role's table"):
        cfg.build(DemoConfig, "demo", parse(["--config", str(path)]))
    path.write_text('[cluster]\nmaster_address = "m:1"\n[demo]\nlisten = "0.0.0.0:7000"\n')
    assert cfg.build(DemoConfig, "demo", parse(["--config", str(path)])).listen == "0.0.0.0:7000"


@pytest.mark.parametrize(
    "role, variable",
    [
        ("master", "HIO_LISTEN"),
        ("master", "HIO_LANE_LISTEN"),
        ("repository", "HIO_HTTP_LISTEN"),
        ("gateway", "HIO_INGEST_LISTEN"),
    ],
)
def test_a_shared_listen_variable_is_refused_and_the_role_s_own_is_named(role, variable, monkeypatch) -> None:
    """Every role started from one environment reads HIO_<NAME>: a shared HIO_LISTEN would
    start the master and the repository of `hio up` on one port, as [cluster] listen would.
    So a role refuses it and names its own variable, which works."""
    from hio.commands import COMMANDS, load

    config_class = load(COMMANDS[role][0])
    monkeypatch.setenv(variable, "127.0.0.1:7999")
    own = f"HIO_{role.upper()}_{variable.removeprefix('HIO_')}"
    with pytest.raises(cfg.ConfigError, match=rf"environment {variable}: .* \({own} for {role}\); a shared"):
        cfg.build(config_class, role)
    monkeypatch.delenv(variable)
    monkeypatch.setenv(own, "127.0.0.1:7999")
    name = variable.removeprefix("HIO_").lower()
    assert getattr(cfg.build(config_class, role), name) == "127.0.0.1:7999"


def test_a_listen_address_is_not_passed_on_to_engines(monkeypatch) -> None:
    """The worker passes HIO_<NAME> of its engines' settings on; never a listen address,
    which the worker sets for each engine. The worker's own (its health server) is its
    alone: HIO_WORKER_LISTEN, never a shared HIO_LISTEN, which would put every role on it."""
    from hio.worker.config import WorkerConfig

    monkeypatch.setenv("HIO_WORKER_LISTEN", "127.0.0.1:7999")
    monkeypatch.setenv("HIO_RPC_DEADLINE", "12")
    worker = cfg.build(WorkerConfig, "worker")
    assert worker.listen == "127.0.0.1:7999"
    assert worker.engine_overrides() == {"rpc_deadline": "12.0"}
    monkeypatch.setenv("HIO_LISTEN", "127.0.0.1:7998")
    with pytest.raises(cfg.ConfigError, match="HIO_WORKER_LISTEN for worker"):
        cfg.build(WorkerConfig, "worker")


def test_missing_or_broken_file_is_a_clear_error(tmp_path) -> None:
    with pytest.raises(cfg.ConfigError, match="not found"):
        cfg.build(DemoConfig, "demo", parse(["--config", str(tmp_path / "nope.toml")]))
    bad = tmp_path / "bad.toml"
    bad.write_text("[demo\n")
    with pytest.raises(cfg.ConfigError, match="not valid TOML"):
        cfg.build(DemoConfig, "demo", parse(["--config", str(bad)]))


def test_cli_reports_config_errors_with_exit_2(capsys) -> None:
    from hio.cli import main

    assert main(["status", "--chunk-bytes", "abc"]) == 2
    assert "chunk-bytes" in capsys.readouterr().err
    assert main(["no-such-command"]) == 2


@pytest.mark.parametrize("command", __import__("hio.commands", fromlist=["COMMANDS"]).COMMANDS)
def test_every_command_prints_its_help(command, capsys) -> None:
    from hio.cli import main

    with pytest.raises(SystemExit) as done:
        main([command, "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: hio {command}") and "--config" in out


@pytest.mark.parametrize("command", ["master", "repository", "worker"])
def test_a_serving_role_with_a_ca_but_no_certificate_is_refused(command, tmp_path, capsys) -> None:
    from hio.cli import main

    ca = tmp_path / "ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    assert main([command, "--tls-ca", str(ca), "--data-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "tls_ca is set without tls_cert" in err and "hio certs" in err


@pytest.mark.parametrize(
    "value", ["127.0.0.1:7000", "0.0.0.0:0", "[::1]:7000", "[::]:7300", ":7000", "master.example.org:65535"]
)
def test_an_address_is_host_and_port(value: str) -> None:
    cfg.check_address("listen", value)


@pytest.mark.parametrize("value", ["7000", "localhost", "host:port", "host:65536", "a b:7000", "host:7000:1", ""])
def test_a_mistyped_address_is_refused_with_its_setting_named(value: str) -> None:
    with pytest.raises(cfg.ConfigError, match=re.escape(f"listen must be host:port, got {value!r}")):
        cfg.check_address("listen", value)


@pytest.mark.parametrize(
    "command, flag",
    [
        ("master", "--listen"),
        ("master", "--lane-listen"),
        ("master", "--http-listen"),
        ("repository", "--listen"),
        ("repository", "--http-listen"),
        ("worker", "--http-listen"),
        ("gateway", "--http-listen"),
        ("kd", "--http-listen"),
        ("engine", "--listen"),
        ("engine", "--lane-listen"),
        ("up", "--http-listen-kd"),
        ("up", "--http-listen-gateway"),
        ("up", "--ingest-listen"),
    ],
)
def test_every_serving_role_checks_its_addresses_the_same_way(command, flag, tmp_path, capsys) -> None:
    from hio.cli import main

    extra = ["--channel-id", "w/0", "--image", "hio/synthetic"] if command == "engine" else []
    assert main([command, flag, "localhost:http", "--data-dir", str(tmp_path), *extra]) == 2
    setting = flag.removeprefix("--").replace("-", "_")
    assert f"{setting} must be host:port, got 'localhost:http'" in capsys.readouterr().err


@pytest.mark.parametrize(
    "command, unlisted, listed",
    [
        ("status", "--tokens-file", "--master-address"),
        ("send", "--ticket-key-file", "--image"),
        ("send", "--watch", "--master-address"),
        ("send", "--http-listen", "--image"),
        ("master", None, "--tokens-file"),
    ],
)
def test_a_client_command_does_not_list_server_settings_but_accepts_them(command, unlisted, listed, capsys) -> None:
    from hio.cli import main

    with pytest.raises(SystemExit):
        main([command, "--help"])
    out = capsys.readouterr().out
    assert listed in out
    if unlisted:
        assert unlisted not in out
        # one configuration file serves every role: the setting is still accepted
        from hio.cli import command_parser
        from hio.commands import COMMANDS, load

        args = command_parser(command, load(COMMANDS[command][0])).parse_args([unlisted, "x"])
        assert getattr(args, unlisted[2:].replace("-", "_")) == "x"


@pytest.mark.parametrize(
    "command, flags",
    [
        ("master", ["--listen", "127.0.0.1:7000", "--http-listen", "127.0.0.1:7000"]),
        ("master", ["--listen", "127.0.0.1:7000", "--http-listen", "0.0.0.0:7001"]),  # the lane's
        ("repository", ["--listen", "127.0.0.1:7100", "--http-listen", ":7100"]),
        ("gateway", ["--ingest-listen", "127.0.0.1:7300", "--http-listen", "127.0.0.1:7300"]),
    ],
)
def test_an_http_endpoint_on_a_port_the_role_serves_grpc_on_is_refused(command, flags, tmp_path, capsys) -> None:
    from hio.cli import main

    assert main([command, *flags, "--data-dir", str(tmp_path)]) == 2
    assert "http_listen" in capsys.readouterr().err


def test_each_role_has_an_http_port_of_its_own_beside_the_defaults() -> None:
    from hio.gateway.config import GatewayConfig
    from hio.kd.config import KDConfig
    from hio.master.config import MasterConfig
    from hio.repository.config import RepositoryConfig
    from hio.worker.config import WorkerConfig

    listens = {"master": MasterConfig().listen, "lane": "127.0.0.1:7001", "repository": RepositoryConfig().listen}
    listens["ingest"] = GatewayConfig().ingest_listen
    for cls in (MasterConfig, RepositoryConfig, WorkerConfig, GatewayConfig, KDConfig):
        listens[cls.__name__] = cls().http_listen
    ports = [cfg.split_address(address)[1] for address in listens.values()]
    assert len(set(ports)) == len(ports), listens
    assert ports[-5:] == [7080, 7180, 7280, 7380, 7480]


@pytest.mark.parametrize(
    "address, message",
    [
        ("master", "master_address must be host:port, got 'master'"),  # gRPC would try port 443
        (":7000", "master_address must name a host"),
    ],
)
def test_a_peer_address_without_a_port_or_host_is_refused(address: str, message: str) -> None:
    from hio.settings import ClusterSettings

    with pytest.raises(cfg.ConfigError, match=re.escape(message)):
        ClusterSettings(master_address=address).validate_cluster()
    ClusterSettings(master_address="dns:///master.example.org:7000").validate_cluster()  # a gRPC target as it is


def test_the_tools_kept_out_of_the_cluster_table_are_commands() -> None:
    from hio.commands import COMMANDS, TOOLS, cluster_setting_names

    assert set(COMMANDS) >= TOOLS
    assert {"max_attempts", "watch", "spark_master", "engines"} <= cluster_setting_names()


@pytest.mark.parametrize(
    ("command", "argv", "setting", "expected"),
    [
        ("send", ["--files", "a.txt"], "files", ("a.txt",)),
        ("send", ["b.txt"], "files", ("b.txt",)),
        ("send", ["--files", "a.txt,c.txt", "b,x.txt"], "files", ("a.txt", "c.txt", "b,x.txt")),
        ("images", ["--action", "list"], "action", ("list",)),
        ("images", ["list"], "action", ("list",)),
    ],
)
def test_a_commands_list_comes_from_its_flag_and_its_positional_arguments(command, argv, setting, expected) -> None:
    """``hio send --files a.txt`` sends a.txt (the positional list, empty, once replaced the
    flag's, and the send finished only what an earlier run left); a positional value is taken
    as given, a comma in a file name included."""
    from hio import commands
    from hio.cli import command_parser, positional_override

    cls_path, section, _run, _help = commands.COMMANDS[command]
    cls = commands.load(cls_path)
    args = command_parser(command, cls).parse_args(argv)
    built = cfg.build(cls, section, args, overrides=positional_override(cls, args), file_data={})
    assert getattr(built, setting) == expected


def test_an_unknown_action_given_by_flag_is_refused_not_replaced_by_the_default(capsys) -> None:
    """``hio images --action nope`` is refused (it once built every image, the default action)."""
    from hio.cli import main

    assert main(["images", "--action", "nope"]) == 2
    assert "action must be one of build, list, base, wheelhouse; got nope" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["master", "--stream-idle-seconds=-1"], "stream_idle_seconds must be 0 (never) or positive, got -1"),
        (["kd", "--stream-idle-seconds=nan"], "stream_idle_seconds must be 0 (never) or positive, got nan"),
        (["gateway", "--spool-memory-bytes=-1"], "spool_memory_bytes must be at least 0, got -1"),
        (["dead-letters", "--retry=-1"], "retry must be between 0 and"),
        (["master", "--log-level", "bogus"], "log_level must be one of debug, info, warning, error, got 'bogus'"),
        (["gateway", "--log-level", "loud"], "log_level must be one of debug, info, warning, error, got 'loud'"),
        (["master", "--provisioner-options", "flavor"], "provisioner_options: 'flavor' must look like NAME=VALUE"),
        (["gateway", "--ingest-listen", "nowhere"], "ingest_listen must be host:port, got 'nowhere'"),
    ],
)
def test_a_setting_a_role_cannot_use_is_refused_by_name_before_it_runs(argv, message, tmp_path, capsys) -> None:
    """Each of these once ran or raised from deep inside: a negative idle bound read as none,
    the spool's ValueError, protobuf's 'Value out of range', a log level read as 'warning',
    provisioner options refused only once elastic scaling started, an ingest address that is
    none as a ValueError traceback."""
    from hio.cli import main

    assert main([*argv, "--data-dir", str(tmp_path)]) == 2
    assert message in capsys.readouterr().err


# The numeric settings for which -1 means something (a rate that falls, a seed, "unchanged").
NEGATIVE_MEANS_SOMETHING = {
    ("master", "slowdown_rate"),
    ("kd", "seed"),
    ("bench-kd", "seed"),
    ("scale", "set_min_workers"),
    ("scale", "set_max_workers"),
}


def _numeric_settings() -> list[tuple[str, str, str]]:
    import typing

    from hio import commands

    found = []
    for command, (cls_path, *_rest) in commands.COMMANDS.items():
        cls = commands.load(cls_path)
        types = typing.get_type_hints(cls)
        for field in dataclasses.fields(cls):
            if types[field.name] is float:
                found += [(command, field.name, "nan"), (command, field.name, "-1")]
            elif types[field.name] is int:
                found.append((command, field.name, "-1"))
    return found


@pytest.mark.parametrize(("command", "name", "value"), _numeric_settings())
def test_every_numeric_setting_refuses_nan_and_negatives_by_name(command, name, value, monkeypatch) -> None:
    """NaN is never a setting, nor is -1 but where it means something: each is refused by the
    setting's name when the configuration is built, before anything runs (not read as 'no
    bound', not a ValueError from deep inside, not an empty run)."""
    from hio import commands
    from hio.cli import command_parser, positional_override

    for variable in [v for v in os.environ if v.startswith("HIO_")]:
        monkeypatch.delenv(variable)
    cls_path, section, _run, _help = commands.COMMANDS[command]
    cls = commands.load(cls_path)
    needed = ["--channel-id", "w/0", "--image", "hio/synthetic"] if command == "engine" else []  # the worker gives them
    args = command_parser(command, cls).parse_args([*needed, f"--{name.replace('_', '-')}={value}"])
    if value == "-1" and (command, name) in NEGATIVE_MEANS_SOMETHING:
        cfg.build(cls, section, args, overrides=positional_override(cls, args), file_data={})
        return
    with pytest.raises(cfg.ConfigError, match=name):
        cfg.build(cls, section, args, overrides=positional_override(cls, args), file_data={})


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["master", "--data-dir", "{blocked}"], "data_dir: cannot create {blocked}/master: Not a directory"),
        (
            ["master", "--data-dir", "/proc/hio-none"],
            "data_dir: cannot create /proc/hio-none/master: No such file or directory",
        ),
        (["repository", "--data-dir", "{blocked}"], "data_dir: cannot create {blocked}/repository: Not a directory"),
        (["gateway", "--data-dir", "{blocked}"], "data_dir: cannot create {blocked}/gateway: Not a directory"),
        (["up", "--data-dir", "{blocked}"], "data_dir: cannot create {blocked}: File exists"),
        (
            ["kd", "--data-dir", "{free}", "--checkpoint-path", "{blocked}/checkpoint"],
            "checkpoint_path: cannot create {blocked}/checkpoint: Not a directory",
        ),
    ],
)
def test_a_data_folder_that_cannot_be_made_is_named_and_nothing_starts(argv, message, tmp_path) -> None:
    """A data folder under a file, or on a path that does not exist, is an operator's mistake:
    one line naming the setting, the folder and why, exit 2, not an OSError traceback."""
    import subprocess
    import sys

    from tests.harness import hio_env

    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    args = [a.format(blocked=blocked, free=tmp_path / "free") for a in argv]
    done = subprocess.run(
        [sys.executable, "-m", "hio.cli", *args, "--http-listen", ""],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=tmp_path,
        env=hio_env(),
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == f"hio {argv[0]}: {message.format(blocked=blocked)}", done.stderr
