"""The command line run in-process on a mistake: its exit code 2 and its one error line."""
from lit_softmoe.cli import main


def _one_line_error(capsys, argv) -> str:
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]
