"""A report's plots are drawn once; the docs copy of the same results copies them (engine.bench.plots.Figures)."""

from __future__ import annotations

from pathlib import Path

from engine.bench.plots import Figures


def _drawer(calls: list[str], content: bytes | None):
    def draw(path: Path) -> Path | None:
        calls.append(path.name)
        if content is None:
            return None  # nothing to plot
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)
        return path
    return draw


def test_the_docs_copy_copies_the_reports_plots_instead_of_drawing_them(tmp_path):
    calls: list[str] = []
    report = Figures(tmp_path / "report" / "img", "img")
    assert report.place("main.png", _drawer(calls, b"PNG-main")) == "img/main.png"
    assert report.place("lam.png", _drawer(calls, None)) is None  # nothing to plot: no link, no file
    assert calls == ["main.png", "lam.png"] and report.placed == {"main.png"}

    docs = Figures(tmp_path / "docs" / "img" / "results", "img/results", drawn_by=report)
    assert docs.place("main.png", _drawer(calls, b"other")) == "img/results/main.png"
    assert (tmp_path / "docs" / "img" / "results" / "main.png").read_bytes() == b"PNG-main"
    assert docs.place("lam.png", _drawer(calls, b"other")) is None
    assert calls == ["main.png", "lam.png"]  # nothing drawn a second time
    assert not (tmp_path / "docs" / "img" / "results" / "lam.png").exists()


def test_a_stale_file_in_the_reports_folder_is_not_copied(tmp_path):
    """A plot an older run drew but this run had nothing for stays out of the docs copy."""
    folder = tmp_path / "report" / "img"
    folder.mkdir(parents=True)
    (folder / "gamma.png").write_bytes(b"old run")
    report = Figures(folder, "img")
    assert report.place("gamma.png", _drawer([], None)) is None
    docs = Figures(tmp_path / "docs", "img/results", drawn_by=report)
    assert docs.place("gamma.png", _drawer([], b"x")) is None and not (tmp_path / "docs" / "gamma.png").exists()
