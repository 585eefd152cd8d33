"""Records of finished runs in a JSONL file, read back to resume, and the prompts sharded over processes.

Every process appends each record as it finishes, so an interrupted command rerun with the same output
folder skips what it already has. Started by `accelerate launch` or torchrun, the prompts are strided over
the processes (each gets some of every dataset) and the records gathered on the main one; the processes
run on the CPU and talk through gloo.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Callable

from drafters.training.parallel import warn_if_started_alone


def append_record(path: Path, record: dict) -> None:
    # One write() on an O_APPEND descriptor: lines from several processes never interleave, and an
    # interruption loses at most the line being written.
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(record) + "\n").encode())
    finally:
        os.close(fd)


def read_records(path: Path, key: Callable[[dict], tuple]) -> list[dict]:
    """Records of a JSONL file, the first one per `key`; unreadable lines (an interrupted write) are skipped."""
    if not path.exists():
        return []
    records, seen = [], set()
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            record_key = key(record)
        except (json.JSONDecodeError, KeyError, TypeError):
            print(
                f"{path}:{number}: unreadable line skipped (an interrupted write?); that run is redone", file=sys.stderr
            )
            continue
        if record_key not in seen:
            seen.add(record_key)
            records.append(record)
    return records


def drop_partial_line(path: Path) -> None:
    """An interrupted write can leave the file ending mid-line: cut that fragment (its run is redone),
    so the next record starts a line of its own."""
    if not path.exists():
        return
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        with open(path, "rb+") as f:
            f.truncate(data.rfind(b"\n") + 1)


RunShard = Callable[[int, int, set[tuple], bool], list[dict]]  # (rank, processes, done keys, show progress)


def resume_sharded(path: Path, key: Callable[[dict], tuple], run_shard: RunShard) -> tuple[list[dict] | None, int]:
    """Read the records already in `path`, run this process's shard of the rest (`run_shard` appends each new
    record to `path`), and gather: (records done before + new ones, processes) on the main process, (None,
    processes) on the others."""
    from accelerate import PartialState
    from accelerate.utils import gather_object

    # cpu=True: the models run on the CPU, and gloo carries gather_object under any launcher.
    state = PartialState(cpu=True)  # one process unless started by `accelerate launch` or torchrun
    warn_if_started_alone(state.num_processes, "running unsharded")
    if state.is_main_process:
        path.parent.mkdir(parents=True, exist_ok=True)
        drop_partial_line(path)
    state.wait_for_everyone()
    done = read_records(path, key)
    state.wait_for_everyone()  # everyone has read the file before anyone appends to it
    new = run_shard(state.process_index, state.num_processes, {key(r) for r in done}, state.is_main_process)
    new = gather_object(new) if state.num_processes > 1 else new
    # Every process is done with the others: close the group now, not at interpreter exit, where tearing down
    # gloo's threads can abort a worker ("terminate called without an active exception", SIGABRT).
    state.destroy_process_group()
    return (done + new if state.is_main_process else None), state.num_processes
