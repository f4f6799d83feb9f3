"""``python -m kvxfer.dynamo ARGS``: Dynamo's vLLM worker (``python -m dynamo.vllm ARGS``)
with ``KvxferConnector`` registered in its PD-protocol registry (see :mod:`kvxfer.dynamo`)."""

from __future__ import annotations

import os
import sys

# As Dynamo's own entry point: a fixed hash seed unless the caller set one (its prefix-cache
# hashes must agree across processes); it takes effect in the processes it starts.
os.environ.setdefault("PYTHONHASHSEED", "0")


def main() -> None:
    from . import DynamoVersionError, register

    try:
        register()
    except DynamoVersionError as e:
        sys.exit(str(e))
    from dynamo.common.snapshot.restore_context import maybe_run_restore_standby_mode

    maybe_run_restore_standby_mode()
    from dynamo.vllm.main import main as dynamo_main

    dynamo_main()


if __name__ == "__main__":
    main()
