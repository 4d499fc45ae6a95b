"""A real nginx (Debian's ``nginx-light``) for tests/app/test_nginx_replicas.py, run from the shipped
``deploy/nginx.conf``: ``nginx_config`` fills in the file's two EDIT places (the replicas, the listen address) and
moves its log and temporary files under the test's directory, nothing else; ``NginxProcess`` runs it in the
foreground as a child of the test.

Without nginx the tests skip with one line, unless ``ROLLWAY_REQUIRE_NGINX=1`` (CI), when they fail."""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Self

from rollway.process import ServerProcess
from support.components import missing

NGINX_CONF = Path(__file__).resolve().parents[2] / "deploy" / "nginx.conf"
#: Where Debian's package puts the binary (``/usr/sbin`` is not on every user's PATH).
DEBIAN_NGINX = "/usr/sbin/nginx"
#: The master logs this (at ``notice``) once it listens and has forked a worker: connections are served.
STARTED_RE = re.compile(r"start worker process \d+")
TEMP_DIRS = ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")


def nginx_binary() -> str | None:
    found = shutil.which("nginx")
    if found is None and os.access(DEBIAN_NGINX, os.X_OK):
        found = DEBIAN_NGINX
    return found


def require_nginx() -> str:
    """Called where a test module is imported: the nginx binary, or the whole module skipped (one line) when
    there is none; failed instead under ``ROLLWAY_REQUIRE_NGINX=1``."""
    binary = nginx_binary()
    if binary is not None:
        return binary
    reason = "no nginx binary on PATH or at /usr/sbin/nginx (Debian: apt-get install nginx-light)"
    missing("nginx tests", "ROLLWAY_REQUIRE_NGINX", reason)


def nginx_config(template: str, *, listen: str, replicas: Sequence[str], scratch: Path) -> str:
    """``template`` (deploy/nginx.conf's text) with one ``server`` line per address in ``replicas`` (each with
    the shipped lines' parameters: max_fails, fail_timeout), ``listen`` as the address served, and its access
    log and temporary files under ``scratch``. Raises ``ValueError`` when the template no longer has a place
    it marks, so that a change to the shipped file cannot leave the test running something else."""
    block = re.search(r"(?m)^([ \t]*)# EDIT replicas.*\n((?:.*\n)*?)[ \t]*# end of replicas\n", template)
    if block is None:
        raise ValueError("deploy/nginx.conf: no '# EDIT replicas' ... '# end of replicas' block")
    indent, body = block.group(1), block.group(2)
    shipped = re.findall(r"(?m)^[ \t]*server[ \t]+\S+([^;\n]*);", body)
    if not shipped:
        raise ValueError("deploy/nginx.conf: no server line between '# EDIT replicas' and '# end of replicas'")
    servers = "".join(f"{indent}server {address}{shipped[0]};\n" for address in replicas)
    text = template[: block.start(2)] + servers + template[block.end(2) :]
    text = _replace_once(text, r"(# EDIT listen.*\n[ \t]*)listen[ \t]+[^;\n]+;", lambda m: f"{m[1]}listen {listen};")
    log = f"access_log {scratch / 'access.log'} rollway;"
    text = _replace_once(text, r"access_log[ \t]+\S+[ \t]+rollway;", lambda _: log)
    temp = "".join(f"    {name}_temp_path {scratch / name};\n" for name in TEMP_DIRS)
    return _replace_once(text, r"(?m)^http \{\n", lambda m: m[0] + temp)


def _replace_once(text: str, pattern: str, replacement: Callable[[re.Match[str]], str]) -> str:
    result, count = re.subn(pattern, replacement, text)
    if count != 1:
        raise ValueError(f"deploy/nginx.conf: expected one match of {pattern!r}, found {count}")
    return result


class NginxProcess(ServerProcess):
    """nginx in the foreground (``daemon off``) on ``config``, in its own process group (its master and
    workers stop together), logging to its stderr, which is read into ``output``. Its ``url`` stays empty: the
    address it listens on is the caller's (``nginx_config``'s ``listen``)."""

    name = "nginx server"
    own_group = True

    def __init__(self, binary: str, config: str, scratch: Path, startup_timeout: float = 15.0) -> None:
        super().__init__([], startup_timeout=startup_timeout)
        self.binary = binary
        self.config = config
        self.scratch = scratch

    def command(self) -> list[str]:
        # pid file and error log are the command line's (the shipped file leaves them to the distribution);
        # as root the workers run as root too, so that they can use the temporary directories under the test's
        # own, which nginx's default user could not enter.
        main = f"daemon off; pid {self.scratch / 'nginx.pid'}; error_log stderr notice;"
        if os.geteuid() == 0:
            main += " user root;"
        return [self.binary, "-p", str(self.scratch), "-c", str(self.scratch / "nginx.conf"), "-g", main]

    def ready(self, line: str) -> str | None:
        return "" if STARTED_RE.search(line) else None

    def start(self) -> Self:
        self.scratch.mkdir(parents=True, exist_ok=True)
        (self.scratch / "nginx.conf").write_text(self.config)
        return super().start()
