"""LLaVA-OneVision-2 codec assets made at pack time: `mmpack pack --codec-videos` runs the preprocessor's
`cv-preinfer` (package `codec-video-prep`, in an environment of its own: it needs numpy < 2) on each raw video
and packs its output folder as a codec video (`codec_assets`). The folders are cached under a key of the video's
bytes and the knobs, so a video is preprocessed once whatever its path, and a changed knob makes it anew.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass

from mmpack.packing.processes import run_tied
from mmpack.packing.video_codec_ov2 import CodecAssetError

EXECUTABLE = "cv-preinfer"
INSTALL_HINT = (
    "cv-preinfer (LLaVA-OneVision-2's codec preprocessor) not found: install it in a venv of its own "
    "(python3.11 -m venv ENV && ENV/bin/pip install codec-video-prep==0.2.5; it also needs ffprobe on PATH), then "
    "pass --cv-preinfer ENV/bin/cv-preinfer"
)
DONE = "mmpack-codec.json"  # written last in a cache folder: its presence means the folder is whole
HASH_BLOCK = 1 << 20


@dataclass(kw_only=True, frozen=True)
class CodecPreinfer:
    """How raw videos become codec assets: the executable, the cache folder and the preprocessor's knobs (the
    defaults are the LLaVA-OneVision-2 processor's: 32 canvases of 4 per group of 32 frames, 150000 pixels)."""

    executable: str
    cache_dir: str
    target_canvases: int = 32
    grouping: str = "readiness"
    images_per_group: int = 4
    group_size: int = 32
    patch_size: int = 14
    max_pixels: int = 150000
    timeout_s: float = 1800.0

    def num_frames(self, total_frames: int) -> int:
        """The frames the preprocessor samples of a video of `total_frames` (the model processor's rule)."""
        return min(self.target_canvases // self.images_per_group * self.group_size, max(1, total_frames))

    def command(self, video: str, out_dir: str, total_frames: int) -> list[str]:
        """The `cv-preinfer` command line for one video."""
        return [
            self.executable, "--video", video, "--out_dir", out_dir,
            "--num_sampled_frames", str(self.num_frames(total_frames)), "--grouping_mode", self.grouping,
            "--group_size", str(self.group_size), "--images_per_group", str(self.images_per_group),
            "--patch", str(self.patch_size), "--max_pixels", str(self.max_pixels),
            "--readiness_sum_threshold", "0", "--min_group_frames", "8", "--max_group_frames", "64",
            "--avoid_keyframes", "--canvas_format", "jpg",
        ]  # fmt: skip

    def assets_of(self, video: str, total_frames: int, *, name: str) -> str:
        """The cache folder of `video`'s codec assets, made by `cv-preinfer` if not cached yet; CodecAssetError
        naming `name` where the preprocessor fails or runs past its time."""
        knobs = self.command("VIDEO", "OUT", total_frames)[1:]
        key = hashlib.sha256(f"{_file_sha256(video)}|{json.dumps(knobs)}".encode()).hexdigest()[:32]
        folder = os.path.join(self.cache_dir, key)
        if os.path.exists(os.path.join(folder, DONE)):
            return folder
        os.makedirs(self.cache_dir, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=f".{key}-", dir=self.cache_dir)
        try:
            self._run(video, tmp, total_frames, name)
            with open(os.path.join(tmp, DONE), "w") as f:
                json.dump({"video_sha256_knobs": key, "knobs": knobs}, f)
            try:
                os.rename(tmp, folder)
            except OSError:  # another worker made the same folder first: its copy is as good
                if not os.path.exists(os.path.join(folder, DONE)):
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return folder

    def _run(self, video: str, out_dir: str, total_frames: int, name: str) -> None:
        try:  # tied: a killed packer, or a timeout, ends cv-preinfer and the ffprobe it runs
            done = run_tied(self.command(video, out_dir, total_frames), timeout_s=self.timeout_s)
        except subprocess.TimeoutExpired:
            raise CodecAssetError(
                f"codec video {name}: cv-preinfer ran past {self.timeout_s:.0f} s; skip the video or give it a "
                "shorter one"
            ) from None
        except OSError as exc:
            raise CodecAssetError(f"codec video {name}: cannot run {self.executable}: {exc}") from None
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["(no output)"])[-1][:300]
            raise CodecAssetError(
                f"codec video {name}: cv-preinfer exited {done.returncode}: {last}; run `{self.executable} "
                "--help` or its cv-preinfer-doctor to check the install"
            )


def find_executable(given: str | None) -> str:
    """The `cv-preinfer` to run: `given` (a path, or a name on PATH), else the one on PATH; FileNotFoundError
    with the one line that says how to get it."""
    found = shutil.which(given or EXECUTABLE)
    if found is None:
        raise FileNotFoundError(f"{given}: not an executable file; {INSTALL_HINT}" if given else INSTALL_HINT)
    return os.path.abspath(found)


def default_cache_dir() -> str:
    """The cache of codec assets without `--codec-cache`: under XDG_CACHE_HOME (or ~/.cache)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "mmpack", "codec-assets")


def _file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(HASH_BLOCK):
            h.update(block)
    return h.hexdigest()
