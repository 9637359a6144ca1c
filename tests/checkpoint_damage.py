"""Ways to damage a saved step, and a snapshot to show that nothing on disk changed
(shared by tests/checkpoint: the persistent tier's tests and the local tier's)."""

import hashlib
import shutil
from pathlib import Path


def snapshot(directory: Path) -> dict[str, str]:
    """Every file below ``directory`` and the hash of its bytes."""
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def largest_data_file(step_dir: Path) -> Path:
    return max((step_dir / "state").rglob("d/*"), key=lambda p: p.stat().st_size)


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


DAMAGE = {
    "flipped-byte": lambda d: flip_a_byte(largest_data_file(d)),
    "truncated": lambda d: largest_data_file(d).write_bytes(b""),
    "metadata-garbage": lambda d: (d / "meta" / "metadata").write_text("{not json"),
    "array-index-missing": lambda d: shutil.rmtree(d / "state" / "ocdbt.process_0"),
}
"""Name -> a function that damages the step directory it is given."""

WHAT = {
    "flipped-byte": r"tensor \S+",  # the fingerprint names the tensor
    "truncated": r"tensor \S+( \(and \d+ more\))?",  # one data file holds several
    "metadata-garbage": r"its metadata \(metadata\)",
    "array-index-missing": r"tensor \S+( \(and \d+ more\))?",
}
"""Name -> how the printed line names what is damaged."""
