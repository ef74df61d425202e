"""The command line run in-process on a mistake: its exit code 2 and its one error line."""
from lit_softmoe.cli import main


def one_line_error(capsys, argv) -> str:
    """Run `lit-softmoe argv`: it must exit 2 with one line on stderr, which is returned."""
    capsys.readouterr()  # what the test printed before (a training run's progress bars) is not the command's
    return one_error_line(capsys, main(argv))


def one_error_line(capsys, code: int) -> str:
    """The one stderr line of a command that returned `code` (which must be 2)."""
    captured = capsys.readouterr()
    assert code == 2, captured.err
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    return lines[0]
