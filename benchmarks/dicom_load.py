"""Loading a DICOM series through ``engine.io`` against SimpleITK's ``ImageSeriesReader`` alone.

Both start from the folder: ours is ``engine.io.readers.open_study(folder)`` (scan headers, group by
series, sort by position, decode, rescale, write into RAS+ canonical order); SimpleITK's is
``GetGDCMSeriesFileNames(folder)`` + ``ImageSeriesReader.Execute()`` + ``GetArrayFromImage``
(GDCM sorts and decodes; ITK applies the rescale; no reorientation). Repetitions are interleaved
(ours, SimpleITK, ours, ...) so a busy machine slows both alike; the script prints the median
of each and their ratio per series (target: ours <= 1.5x SimpleITK). Reference: SimpleITK's
reader with the file names given (no folder scan), for transparency.

    python benchmarks/dicom_load.py [--repeats 9] [--data ../shared/data] [--sitk-threads N]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SERIES = {
    "ProstateX T2 (384x384x19, uncompressed MR)": "dicom/ProstateX-0000_t2_tse_tra",
    "I2CVB T2W (448x360x64, uncompressed MR)": "prostate/I2CVB_T2W/t2w_series",
    "TotalSegmentator CT (512x512x20, JPEG 2000, no suffix)": "dicom/TotalSegmentator_example_ct_dicom",
}


def load_engine(folder: Path) -> tuple[int, ...]:
    from engine.io.readers import open_study

    return open_study(folder).array.shape


def load_sitk(folder: Path) -> tuple[int, ...]:
    import SimpleITK as sitk

    reader = sitk.ImageSeriesReader()
    reader.SetFileNames(reader.GetGDCMSeriesFileNames(str(folder)))
    return sitk.GetArrayFromImage(reader.Execute()).shape


def load_sitk_names_given(names: tuple[str, ...]) -> tuple[int, ...]:
    import SimpleITK as sitk

    reader = sitk.ImageSeriesReader()
    reader.SetFileNames(names)
    return sitk.GetArrayFromImage(reader.Execute()).shape


def timed(fn, *args) -> float:  # type: ignore[no-untyped-def]
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data")
    parser.add_argument("--sitk-threads", type=int, default=0,
                        help="ITK threads (default 0: SimpleITK's own default; ours decodes on one thread)")
    args = parser.parse_args()
    import SimpleITK as sitk

    sitk.ProcessObject.SetGlobalWarningDisplay(False)  # ITK warns on every read of slightly uneven series
    if args.sitk_threads > 0:
        sitk.ProcessObject.SetGlobalDefaultNumberOfThreads(args.sitk_threads)
    print(f"SimpleITK {sitk.Version_VersionString()}, "
          f"{sitk.ProcessObject.GetGlobalDefaultNumberOfThreads()} ITK thread(s); {args.repeats} interleaved repeats")
    found = {name: args.data / rel for name, rel in SERIES.items() if (args.data / rel).is_dir()}
    if not found:
        print(f"no series found under {args.data}; pass --data")
        return 1
    print(f"{'series':58s} {'engine.io':>10s} {'SimpleITK':>10s} {'ratio':>6s} {'(names given)':>14s}")
    worst = 0.0
    for name, folder in found.items():
        names = tuple(sitk.ImageSeriesReader.GetGDCMSeriesFileNames(str(folder)))
        load_engine(folder), load_sitk(folder)  # warm-up: imports, file cache
        ours, theirs, given = [], [], []
        for _ in range(args.repeats):
            ours.append(timed(load_engine, folder))
            theirs.append(timed(load_sitk, folder))
            given.append(timed(load_sitk_names_given, names))
        a, b, c = statistics.median(ours), statistics.median(theirs), statistics.median(given)
        worst = max(worst, a / b)
        print(f"{name:58s} {a * 1000:8.1f}ms {b * 1000:8.1f}ms {a / b:6.2f} {c * 1000:12.1f}ms")
    print(f"largest ratio engine.io / SimpleITK: {worst:.2f} (target <= 1.5)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
