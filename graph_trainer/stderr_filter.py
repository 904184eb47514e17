"""``run_train.sh`` pipes torchrun's stderr through this filter.

Once a worker has printed this project's one-paragraph ``error: ...`` (a
:class:`graph_trainer.errors.UserError`: bad input, a corrupt checkpoint, a NaN loss),
the lines torchrun itself adds afterwards -- its ``ChildFailedError`` traceback and
failure report, which say nothing more -- are dropped. Worker lines (``[rankN]:``
prefixed) always pass, and nothing is dropped before such an error, so torchrun's own
failures stay visible. The exit status is :data:`SAW_USER_ERROR` when such an error was
seen (run_train.sh then exits 2, the code of a user error, instead of torchrun's 1), else 0.
"""

import re
import sys

_WORKER = re.compile(r"^\[(rank|default)\d*\]:")
SAW_USER_ERROR = 3


def main() -> int:
    seen_error = False
    for line in sys.stdin:
        worker = bool(_WORKER.match(line))
        if worker and re.match(r"^\[\w+\]:error: ", line):
            seen_error = True
        if seen_error and not worker:
            continue
        sys.stderr.write(line)
        sys.stderr.flush()
    return SAW_USER_ERROR if seen_error else 0


if __name__ == "__main__":
    sys.exit(main())
