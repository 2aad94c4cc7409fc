"""A deployment's networks on one machine: Linux network namespaces, a router, its firewall.

Each host is a network namespace linked on its own to a router namespace by a veth pair (as
each port of a cloud network has security groups of its own). The router forwards between the
links, and its FORWARD chain is the table "Who connects to whom" of docs/deploy.md, read from
that file (:func:`deploy_flows`): policy DROP, for each connection a role opens one ACCEPT per
pair of hosts and one for its answers back (ESTABLISHED), each with a comment that names it and
a byte counter (:meth:`Topology.counters`). Nothing is linked to this machine's own network, and
the router has no route out: what the roles send stays in the namespaces.

The namespaces are named ``hiotopo-<pid>-<start ticks>-<host>``: names no other run uses.
:meth:`Topology.build` first starts a reaper (:class:`tests.reaper.Reaper`, ``python -m
tests.topology.network --reap <tag>``), so the namespaces of a run that is killed, SIGKILL
included, go when it ends; what a reaper could not remove, the next run recognises (its process
is gone) and removes (:func:`remove_stale`). Removing a namespace removes its links and the
router's rules; the roles in it end with the run that started them.

This process reaches an address inside a namespace through a :class:`~tests.harness.CuttingProxy`
on its own loopback whose connections are opened from inside the namespace
(:meth:`Topology.relay`), as an operator would look from the host itself.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TypeVar

from tests.harness import CuttingProxy
from tests.reaper import Reaper, reap, run_gone, run_id

T = TypeVar("T")

DEPLOY_DOC = Path(__file__).resolve().parents[2] / "docs" / "deploy.md"
TABLE_HEADING = "### Who connects to whom"
ENGINE_PORTS = "engine ports"  # the table's name for the range the workers' engines listen in
PREFIX = "hiotopo"
NETNS_DIR = Path("/run/netns")
_CLONE_NEWNET = 0x40000000


@dataclasses.dataclass(frozen=True)
class Flow:
    """One row of the table: hosts of role ``source`` open connections to hosts of role
    ``target`` on ``port`` (a number, or :data:`ENGINE_PORTS`)."""

    source: str
    target: str
    port: str
    purpose: str


def deploy_flows(doc: Path = DEPLOY_DOC) -> list[Flow]:
    """The rows of the table under :data:`TABLE_HEADING` in ``doc``."""
    lines = doc.read_text().splitlines()
    try:
        start = lines.index(TABLE_HEADING)
    except ValueError:
        raise AssertionError(f"{doc} has no section '{TABLE_HEADING}'") from None
    rows = []
    for line in lines[start + 1 :]:
        if line.startswith("#"):
            break
        if not line.startswith("|"):
            if rows:
                break
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if cells[0] in ("from", "") or set(cells[0]) <= {"-"}:
            continue
        rows.append(Flow(*cells[:4]))
    if not rows:
        raise AssertionError(f"the section '{TABLE_HEADING}' of {doc} has no table rows")
    return rows


@dataclasses.dataclass(frozen=True)
class Host:
    """A host of the deployment: its name, the role it runs, its network, and its address."""

    name: str
    role: str
    network: str
    address: str

    @property
    def router_address(self) -> str:
        """The router's end of the host's link (its default gateway)."""
        return self.address.rsplit(".", 1)[0] + ".1"


def default_hosts() -> list[Host]:
    """The deployment of docs/deploy.md in small: the gateway at the instrument site (edge),
    the master and an operator's machine in the public network, the repository, KD and two
    workers in the private network. Each host has a /24 link of its network's /16."""
    networks = {"edge": 71, "public": 72, "private": 73}
    layout = [
        ("gateway", "gateway", "edge"),
        ("master", "master", "public"),
        ("operator", "operator", "public"),
        ("repository", "repository", "private"),
        ("kd", "kd", "private"),
        ("worker1", "worker", "private"),
        ("worker2", "worker", "private"),
    ]
    return [
        Host(name, role, network, f"10.{networks[network]}.{n}.2")
        for n, (name, role, network) in enumerate(layout, start=1)
    ]


def run(command: Sequence[str], *, stdin: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run a command (ip, iptables); a failure raises with its words."""
    done = subprocess.run(list(command), input=stdin, capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}): {done.stderr.strip() or done.stdout}")
    return done


def unavailable() -> str:
    """Why namespaces, veth pairs and iptables cannot be used here ('' when they can)."""
    if os.geteuid() != 0:
        return "needs root: network namespaces, veth pairs and iptables rules"
    tools = ("ip", "iptables", "iptables-restore", "iptables-save", "sysctl")
    missing = [tool for tool in tools if shutil.which(tool) is None]
    if missing:
        return f"needs {', '.join(missing)} (iproute2, iptables, procps)"
    probe = f"{PREFIX}-probe-{os.getpid()}"
    try:
        run(["ip", "netns", "add", probe])
        rules = "*filter\n:FORWARD DROP [0:0]\n-A FORWARD -m conntrack --ctstate ESTABLISHED -j ACCEPT\nCOMMIT\n"
        run(["ip", "netns", "exec", probe, "iptables-restore"], stdin=rules)
        run(["ip", "-n", probe, "link", "add", "name", "a", "type", "veth", "peer", "name", "b"])
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
        return f"network namespaces, veth pairs or iptables (conntrack) do not work here: {exc}"
    finally:
        run(["ip", "netns", "del", probe], check=False)
    return ""


def our_namespaces() -> list[str]:
    """Names of the namespaces made by any run of this module (live or not)."""
    try:
        return sorted(p.name for p in NETNS_DIR.iterdir() if p.name.startswith(f"{PREFIX}-"))
    except FileNotFoundError:
        return []


def made_by(tag: str) -> list[str]:
    """The namespaces of the run tagged ``tag`` (:attr:`Topology.tag`)."""
    return [name for name in our_namespaces() if name.startswith(f"{tag}-")]


def remove_run(tag: str) -> list[str]:
    """Delete the namespaces of the run tagged ``tag``; the names of those deleted."""
    return [name for name in made_by(tag) if run(["ip", "netns", "del", name], check=False).returncode == 0]


def remove_stale() -> list[str]:
    """Remove the namespaces of runs whose process is gone (killed before it cleaned up);
    those of runs still going are theirs. Returns the names removed."""
    runs = {match[1] for name in our_namespaces() if (match := re.fullmatch(rf"{PREFIX}-(\d+-\d+)-.+", name))}
    return [name for owner in sorted(runs) if run_gone(owner) for name in remove_run(f"{PREFIX}-{owner}")]


def in_netns(netns: str, make: Callable[[], T]) -> T:
    """``make()`` on a thread that joined network namespace ``netns``: a socket made there
    belongs to that namespace, wherever it is used afterwards. This thread stays where it is."""
    box: list[T] = []
    error: list[BaseException] = []

    def join_and_make() -> None:
        try:
            fd = os.open(NETNS_DIR / netns, os.O_RDONLY)
            try:
                libc = ctypes.CDLL(None, use_errno=True)
                if libc.setns(fd, _CLONE_NEWNET) != 0:
                    errno = ctypes.get_errno()
                    raise OSError(errno, f"setns into {netns}: {os.strerror(errno)}")
            finally:
                os.close(fd)
            box.append(make())
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            error.append(exc)

    thread = threading.Thread(target=join_and_make, name=f"in-{netns}", daemon=True)
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return box[0]


class Topology:
    """The hosts, their links to the router, and the router's firewall built from ``flows``.

    ``engine_ports`` (first, last): the range the workers' engines listen in, which the
    table's :data:`ENGINE_PORTS` means. :meth:`build` makes everything, :meth:`remove` takes
    all of it away again (also after a partial build).
    """

    def __init__(self, flows: Sequence[Flow], engine_ports: tuple[int, int], hosts: Iterable[Host] = ()) -> None:
        self.flows = list(flows)
        self.engine_ports = engine_ports
        self.hosts = {h.name: h for h in (hosts or default_hosts())}
        self.tag = f"{PREFIX}-{run_id()}"
        self._relays: dict[tuple[str, str], CuttingProxy] = {}
        self._lock = threading.Lock()
        self._reaper: Reaper | None = None

    # -- names and addresses -----------------------------------------------------------

    def netns(self, host: str) -> str:
        return f"{self.tag}-{host}"

    @property
    def router(self) -> str:
        return self.netns("router")

    def prefix(self, host: str) -> list[str]:
        """The command that runs a program on ``host`` (as it, not as its child)."""
        return ["ip", "netns", "exec", self.netns(host)]

    def address(self, host: str, port: int | None = None) -> str:
        address = self.hosts[host].address
        return address if port is None else f"{address}:{port}"

    def host_of(self, address: str) -> str:
        """The host whose address ``address`` (host:port) is."""
        ip = address.rsplit(":", 1)[0]
        for host in self.hosts.values():
            if host.address == ip:
                return host.name
        raise KeyError(f"no host of this topology has the address {ip}")

    def by_role(self, role: str) -> list[Host]:
        return [h for h in self.hosts.values() if h.role == role]

    def ports(self, flow: Flow) -> str:
        """The flow's port for iptables (a range as first:last)."""
        if flow.port == ENGINE_PORTS:
            return f"{self.engine_ports[0]}:{self.engine_ports[1]}"
        return str(int(flow.port))

    # -- building and removing -----------------------------------------------------------

    def build(self) -> None:
        """The router, every host and its link, routes, and the firewall."""
        self._reaper = Reaper("tests.topology.network", self.tag)  # before anything it would remove
        run(["ip", "netns", "add", self.router])
        self._quiet(self.router)
        run(["ip", "netns", "exec", self.router, "sysctl", "-qw", "net.ipv4.ip_forward=1"])
        for host in self.hosts.values():
            ns, outside = self.netns(host.name), f"r-{host.name}"[:15]
            run(["ip", "netns", "add", ns])
            self._quiet(ns)
            veth = f"name eth0 type veth peer name {outside} netns {self.router}"
            run(["ip", "-n", ns, "link", "add", *veth.split()])
            run(["ip", "-n", ns, "addr", "add", f"{host.address}/24", "dev", "eth0"])
            run(["ip", "-n", self.router, "addr", "add", f"{host.router_address}/24", "dev", outside])
            for where, device in ((ns, "eth0"), (self.router, outside)):
                run(["ip", "-n", where, "link", "set", device, "up"])
            run(["ip", "-n", ns, "route", "add", "default", "via", host.router_address])
        run(["ip", "netns", "exec", self.router, "iptables-restore"], stdin=self.ruleset())

    def _quiet(self, ns: str) -> None:
        """Loopback up, IPv6 off (no router solicitations or address checks on the links)."""
        run(["ip", "-n", ns, "link", "set", "lo", "up"])
        run(["ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1"], check=False)
        run(["ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv6.conf.default.disable_ipv6=1"], check=False)

    def remove(self) -> list[str]:
        """Close the relays and delete every namespace of this topology (their links and the
        router's rules go with them). Returns those still there."""
        with self._lock:
            relays, self._relays = list(self._relays.values()), {}
        for relay in relays:
            relay.close()
        remove_run(self.tag)
        left = made_by(self.tag)
        if self._reaper is not None:
            self._reaper.close()
            self._reaper = None
        return left

    # -- the firewall --------------------------------------------------------------------

    def rules(self) -> list[tuple[str, str]]:
        """(comment, iptables match) of every ACCEPT in FORWARD, in order: for each flow and
        pair of hosts, its connections (``src>dst:port``) and their answers (``src<dst:port``)."""
        rules = []
        for flow in self.flows:
            port = self.ports(flow)
            for source in self.by_role(flow.source):
                for target in self.by_role(flow.target):
                    name = f"{source.name}>{target.name}:{flow.port.replace(' ', '_')}"
                    there = f"-s {source.address}/32 -d {target.address}/32 -p tcp -m tcp --dport {port}"
                    back = f"-s {target.address}/32 -d {source.address}/32 -p tcp -m tcp --sport {port}"
                    rules.append((name, there))
                    rules.append((name.replace(">", "<", 1), f"{back} -m conntrack --ctstate ESTABLISHED"))
        return rules

    def ruleset(self) -> str:
        """The router's filter table for iptables-restore: the router takes no connection
        itself, and forwards only the table's connections and their answers (and the ICMP
        errors that belong to them)."""
        lines = ["*filter", ":INPUT DROP [0:0]", ":FORWARD DROP [0:0]", ":OUTPUT ACCEPT [0:0]"]
        lines.append("-A INPUT -i lo -j ACCEPT")
        lines += [f'-A FORWARD {match} -m comment --comment "{name}" -j ACCEPT' for name, match in self.rules()]
        lines.append('-A FORWARD -m conntrack --ctstate RELATED -m comment --comment "related" -j ACCEPT')
        lines.append("COMMIT")
        return "\n".join(lines) + "\n"

    def counters(self) -> dict[str, int]:
        """Bytes the router forwarded under each rule, by its comment; ``dropped`` for the
        FORWARD policy (everything no rule allowed)."""
        saved = run(["ip", "netns", "exec", self.router, "iptables-save", "-c", "-t", "filter"]).stdout
        counts = {}
        for line in saved.splitlines():
            if line.startswith(":FORWARD"):
                counts["dropped"] = int(line.rsplit(":", 1)[1].rstrip("]"))
            match = re.match(r'\[\d+:(\d+)\] -A FORWARD .*--comment "?([^" ]+)"? ', line)
            if match:
                counts[match[2]] = counts.get(match[2], 0) + int(match[1])
        return counts

    def block(self, source: str, target: str, port: int) -> Callable[[], None]:
        """Drop every packet from host ``source`` to ``target`` on ``port`` (a blocked port
        in a firewall); returns what lifts it again."""
        match = f"-s {self.address(source)}/32 -d {self.address(target)}/32 -p tcp --dport {port} -j DROP".split()
        run(["ip", "netns", "exec", self.router, "iptables", "-w", "-I", "FORWARD", "1", *match])

        def unblock() -> None:
            run(["ip", "netns", "exec", self.router, "iptables", "-w", "-D", "FORWARD", *match])

        return unblock

    def cut(self, host: str) -> None:
        """Pull the host's cable: its link at the router goes down (and with it the route)."""
        run(["ip", "-n", self.router, "link", "set", f"r-{host}"[:15], "down"])

    def mend(self, host: str) -> None:
        """Plug the host's cable in again."""
        run(["ip", "-n", self.router, "link", "set", f"r-{host}"[:15], "up"])

    # -- reaching into the namespaces ------------------------------------------------------

    def relay(self, host: str, address: str) -> str:
        """A loopback address of this process whose connections reach ``address`` from
        inside ``host`` (as if this process were on that host)."""
        with self._lock:
            relay = self._relays.get((host, address))
            if relay is None:
                ns = self.netns(host)
                relay = CuttingProxy(address, connect=lambda target: in_netns(ns, lambda: _connect(target, 5.0)))
                self._relays[(host, address)] = relay
            return relay.address

    def reach(self, address: str) -> str:
        """:meth:`relay` to ``address`` from the host that has it (for ``LocalCluster.reach``)."""
        return self.relay(self.host_of(address), address)

    def connect(self, host: str, address: str, timeout: float = 1.0) -> str:
        """Open a TCP connection from ``host`` to ``address``: 'open', 'refused' (the firewall
        let it through and nothing listens) or 'dropped' (no answer within ``timeout``)."""

        def attempt() -> str:
            try:
                _connect(address, timeout).close()
            except ConnectionRefusedError:
                return "refused"
            except TimeoutError:
                return "dropped"
            except OSError as exc:  # no route (a cut link): the router said so
                return f"unreachable ({exc.strerror})"
            return "open"

        return in_netns(self.netns(host), attempt)


def _connect(address: str, timeout: float) -> socket.socket:
    host, port = address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=timeout)
    sock.settimeout(None)
    return sock


if __name__ == "__main__":
    if sys.argv[1:2] == ["--reap"]:  # a run's reaper (Topology.build)
        reap(sys.argv[2], remove_run)
