"""``make fuzz``: the in-process fuzz target (tests/fuzzing.py) under atheris (libFuzzer's coverage-guided
mutation of the input bytes). Runs at least ``-runs`` inputs (default 1,000,000) and stops at the first
input that breaks an invariant or lets an exception escape the broker, saving it as ``crash-<sha1>`` under
``-artifact_prefix`` (default ``./var/fuzz/``). Reproduce one with ``.venv/bin/python tests/fuzz_main.py FILE``.

Usage: .venv/bin/python tests/fuzz_main.py [libFuzzer flags, e.g. -runs=1000000 -seed=1 -max_len=600]

``FUZZ_STORE=lmdb`` in the environment runs the broker on the real LmdbStore (tests/fuzzing.py, ``store_dir``) in
``./lmdb-store`` (each input's store removed after it; libFuzzer ends the process without Python's clean-up, so a
temporary directory elsewhere would be left behind), or ``FUZZ_STORE_DIR``: every change is committed alone, so on
a disk each is an fsync (about 10 inputs a second) and in /dev/shm it is not (about 150); the default is the
in-memory RowStore.
"""

from __future__ import annotations

import logging
import os
import sys

import atheris

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

with atheris.instrument_imports(include=["gateway", "fuzzing"]):
    import fuzzing

RUNS = 1_000_000
STORE_DIR: str | None = None


def one_input(data: bytes) -> None:
    """libFuzzer's entry point: one input through the harness."""
    fuzzing.run_input(data, STORE_DIR)


def main() -> None:
    global STORE_DIR
    logging.disable(logging.CRITICAL)  # every protocol error would log a line
    store = os.environ.get("FUZZ_STORE", "memory")
    if store not in ("memory", "lmdb"):
        sys.exit(f"FUZZ_STORE={store!r}: must be memory (default) or lmdb")
    if store == "lmdb":
        STORE_DIR = os.path.abspath(os.environ.get("FUZZ_STORE_DIR") or "lmdb-store")
        os.makedirs(STORE_DIR, exist_ok=True)
    args = list(sys.argv)
    if not any(a.startswith("-runs=") for a in args[1:]) and not any(os.path.isfile(a) for a in args[1:]):
        args.append(f"-runs={RUNS}")
    if not any(a.startswith("-max_len=") for a in args[1:]):
        args.append("-max_len=600")
    if not any(a.startswith("-artifact_prefix=") for a in args[1:]):
        os.makedirs("var/fuzz", exist_ok=True)
        args.append("-artifact_prefix=var/fuzz/")
    atheris.Setup(args, one_input)
    atheris.Fuzz()  # exits the process; libFuzzer prints "Done N runs in S second(s)"


if __name__ == "__main__":
    main()
