"""The one error type for user mistakes, and the wrapper that prints it as one line.

A `UserError`'s message is one sentence naming the file, the field and the fix. It imports nothing heavy, so every
module (the planner and `finetune launch` included) can raise it without pulling in trl or torch.
"""

import os
import sys


class UserError(Exception):
    """A mistake in a recipe, flag, config file or dataset, reported as one sentence naming the file, field and fix."""


class RunFinished(Exception):
    """A relaunch of a run whose final model is complete: said in one line, nothing changed, exit 0."""

    def __init__(self, output_dir: str, step: int, can_train_on: bool):
        way_on = ("raise --max_steps to train on from its last checkpoint" if can_train_on else
                  "it has no checkpoint to train on from (save_strategy), so a higher --max_steps is refused unless "
                  "--replace_finished_model true trains it again from step 0")
        super().__init__(f"{output_dir} holds this run's complete final model (step {step}); nothing was changed. "
                         f"Pick a new --output_dir to train again, or {way_on}.")
        self.output_dir = output_dir


FINISHED_PREFIX = "[finetune] finished already: "  # how say_finished's line starts


def first_line(error: Exception) -> str:
    """Another library's error message as a clause of one of ours: its first line, or its type when it has none."""
    return str(error).strip().splitlines()[0].rstrip(".") if str(error).strip() else type(error).__name__


def one_sentence(error: Exception) -> str:
    """Another library's message as a clause of ours: on one line, ending in a full stop."""
    text = " ".join(str(error).split())
    return text if text.endswith(".") else text + "."


def say(message: str, stream=None) -> None:
    """The one way the toolkit tells the user something: one `[finetune] ` line from the main process (one line per
    run, not one per process), flushed at once (launchers and notebooks interleave several processes' output)."""
    if os.environ.get("RANK", "0") == "0":
        print(f"[finetune] {message}", file=stream or sys.stdout, flush=True)


def say_finished(finished: RunFinished) -> None:
    say(f"{FINISHED_PREFIX.removeprefix('[finetune] ')}{finished}")


def report(error: UserError) -> int:
    """Print a user mistake as one line on stderr; the exit code that goes with it."""
    print(f"error: {error}", file=sys.stderr, flush=True)
    return 2


def exit_on_user_error(main) -> None:
    """Run `main`; a user mistake ends as one line on stderr and exit code 2, without a traceback. Either way the
    outcome is written for the launcher (finetune/outcome.py)."""
    from finetune import outcome

    try:
        main()
    except UserError as error:
        outcome.record(outcome.USER_ERROR, error=str(error))
        sys.exit(report(error))
    except RunFinished as finished:
        outcome.record(outcome.FINISHED_ALREADY, output_dir=finished.output_dir)
        say_finished(finished)
        sys.exit(0)
