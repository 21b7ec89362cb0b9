"""One rank of a DeepSpeed script on zerort: `import deepspeed` resolved to zerort's drop-in
(zerort.integrations.deepspeed.alias), then the script run as __main__.

    python -m zerort.integrations.deepspeed.run train.py [script args]

The launcher (zerort.integrations.deepspeed.launcher) starts this in every rank; it can
also run one process by hand. Like DeepSpeed's launcher it passes --local_rank=N (from
LOCAL_RANK, or the MPI launcher's local rank) before the script's own arguments, unless
ZERORT_DS_NO_LOCAL_RANK=1; with ZERORT_DS_MODULE=1 the script is a module name.
"""
import os
import runpy
import sys

from zerort.integrations.deepspeed import alias


def main():
    if len(sys.argv) < 2:
        raise SystemExit("usage: python -m zerort.integrations.deepspeed.run SCRIPT [ARGS...]")
    script, args = sys.argv[1], sys.argv[2:]
    alias.install()
    if os.environ.get("ZERORT_DS_NO_LOCAL_RANK") != "1":
        from zerort import comm

        args = [f"--local_rank={comm.detect_launch_env()['local_rank']}"] + args
    sys.argv = [script] + args
    if os.environ.get("ZERORT_DS_MODULE") == "1":
        runpy.run_module(script, run_name="__main__", alter_sys=True)
    else:
        sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
        runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
