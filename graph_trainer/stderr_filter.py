"""``run_train.sh`` pipes torchrun's stderr through this filter.

After a worker's one-paragraph ``error: ...`` (a :class:`graph_trainer.errors.UserError`), the lines torchrun adds (its
``ChildFailedError`` traceback and report) are dropped; worker (``[rankN]:``) lines and anything before such an error
always pass. Exits :data:`SAW_USER_ERROR` when such an error was seen (run_train.sh then exits 2), else 0."""

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
