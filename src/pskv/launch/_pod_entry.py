"""A restarted pod's container learns its restart count, then runs the real command.

``python -m pskv.launch._pod_entry COUNT_FILE MAX_RESTARTS -- COMMAND...`` is what the
kubernetes launcher makes a server's or worker's container run when ``--max-restarts``
lets the kubelet restart it (restartPolicy OnFailure). The kubelet restarts the container
with the same environment and tells it nothing, but a pskv process must know it is a
restart (``PSKV_RESTART``: a server then reloads its shard, a worker catches up;
docs/durability.md). COUNT_FILE sits in an emptyDir volume, which outlives the container
but not the pod: each start reads the count there, writes count + 1, sets
``PSKV_RESTART=count`` and replaces itself with COMMAND (``os.execvp``: signals and the exit
status are COMMAND's). A start past MAX_RESTARTS exits 1 without running it.
"""
from __future__ import annotations

import logging
import os
import sys
from typing import Callable, Mapping, Sequence

from .._ps.config import ENV_RESTART

__all__ = ["main", "next_restart"]

logger = logging.getLogger(__name__)


def next_restart(count_file: str) -> int:
    """This start's restart count (0 the first time); records the next one in the file."""
    try:
        with open(count_file, encoding="ascii") as f:
            count = int(f.read().strip() or 0)
    except FileNotFoundError:
        count = 0
    except (OSError, ValueError) as err:
        # unreadable: count it as one more restart rather than as the first start
        logger.warning("cannot read the restart count in %s (%s); counting this as a "
                       "restart", count_file, err)
        count = 1
    tmp = f"{count_file}.tmp"
    with open(tmp, "w", encoding="ascii") as f:
        f.write(str(count + 1))
    os.replace(tmp, count_file)  # atomic: a crash leaves the old count or the new one
    return count


def main(argv: Sequence[str] | None = None, *, environ: Mapping[str, str] | None = None,
         execvpe: Callable[[str, list[str], dict[str, str]], object] = os.execvpe) -> int:
    """Run COMMAND with ``PSKV_RESTART`` set; returns only when it cannot (2: usage, 1:
    past MAX_RESTARTS)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 4 or args[2] != "--" or not args[1].isdigit():
        logger.error("usage: python -m pskv.launch._pod_entry COUNT_FILE MAX_RESTARTS -- "
                     "COMMAND...")
        return 2
    count_file, limit, command = args[0], int(args[1]), args[3:]
    count = next_restart(count_file)
    if count > limit:
        logger.error("this container was restarted %d times, more than --max-restarts %d; "
                     "not starting %s again", count, limit, command[0])
        return 1
    env = dict(os.environ if environ is None else environ)
    env[ENV_RESTART] = str(count)
    execvpe(command[0], command, env)
    return 1  # only a replacement execvpe returns


if __name__ == "__main__":
    sys.exit(main())
