"""The packages a vLLM wheel needs beyond what the device image holds, for a lease with no network.

    python bench/vllm_gpu/resolve.py --image bench/vllm_gpu/image-freeze.txt --out .cache/vllm-gpu \
        vllm==0.22.0 [--skip flashinfer-cubin ...]

pip resolves the requirement for the image's interpreter (cp312, manylinux x86_64) as if the image's
packages were installed: each `name==version` line of the image's `pip list --format=freeze` becomes
an empty wheel `name-version+image` (no dependencies) in a local folder, pinned by a constraint, so
the resolver takes the image's torch and never walks into its CUDA wheels. What remains is what the
lease must carry; `--download` fetches those wheels (no dependencies, one version each) into
`--out/wheels` and writes `--out/missing.json` (name, version, bytes, url file name).
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import re
import subprocess
import sys
import zipfile
from pathlib import Path

PLATFORMS = ["manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_27_x86_64", "manylinux_2_28_x86_64",
             "manylinux_2_31_x86_64", "manylinux_2_34_x86_64", "manylinux_2_35_x86_64", "linux_x86_64"]
LOCAL = "image"  # the local version label of the stand-in wheels


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_freeze(path: Path) -> dict[str, str]:
    """{normalised name: version} from `pip list --format=freeze` lines (editable and URL lines skipped)."""
    out: dict[str, str] = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#") or "==" not in line:
            continue
        name, version = line.split("==", 1)
        out[norm(name)] = version.split("+", 1)[0]
    return out


def stub_wheel(folder: Path, name: str, version: str) -> None:
    """An empty py3-none-any wheel `name==version+image` with no dependencies."""
    dist = f"{name.replace('-', '_')}-{version}+{LOCAL}"
    files = {f"{dist}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}+{LOCAL}\n",
             f"{dist}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: specops\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(text.encode())}")
    record.append(f"{dist}.dist-info/RECORD,,")
    files[f"{dist}.dist-info/RECORD"] = "\n".join(record) + "\n"
    with zipfile.ZipFile(folder / f"{dist}-py3-none-any.whl", "w") as z:
        for path, text in files.items():
            z.writestr(path, text)


def resolve(requirement: str, image: dict[str, str], work: Path) -> list[dict]:
    stubs = work / "image-stubs"
    stubs.mkdir(parents=True, exist_ok=True)
    for name, version in image.items():
        stub_wheel(stubs, name, version)
    constraints = work / "image-constraints.txt"
    constraints.write_text("".join(f"{n}=={v}+{LOCAL}\n" for n, v in sorted(image.items())))
    report = work / "report.json"
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--dry-run", "--ignore-installed", "--report", str(report),
           "--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
           *[a for p in PLATFORMS for a in ("--platform", p)], "--target", str(work / "never"),
           "--find-links", str(stubs), "-c", str(constraints), requirement]
    subprocess.run(cmd, check=True)
    rows = []
    for item in json.loads(report.read_text())["install"]:
        meta = item["metadata"]
        if meta["version"].endswith(f"+{LOCAL}"):
            continue
        rows.append({"name": norm(meta["name"]), "version": meta["version"],
                     "file": item["download_info"]["url"].rsplit("/", 1)[-1]})
    return sorted(rows, key=lambda r: r["name"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("requirement")
    ap.add_argument("--image", type=Path, required=True, help="the image's `pip list --format=freeze`")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--skip", nargs="*", default=[], help="packages the lease leaves out (said in missing.json)")
    ap.add_argument("--download", action="store_true")
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    rows = resolve(a.requirement, read_freeze(a.image), a.out)
    skip = {norm(s) for s in a.skip}
    if a.download:
        wheels = a.out / "wheels"
        wheels.mkdir(exist_ok=True)
        for r in rows:
            if r["name"] in skip:
                continue
            if not (wheels / r["file"]).exists():
                subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                                "--python-version", "3.12", "--implementation", "cp",
                                *[x for p in PLATFORMS for x in ("--platform", p)], "-d", str(wheels),
                                f"{r['name']}=={r['version']}"], check=True)
            r["bytes"] = (wheels / r["file"]).stat().st_size if (wheels / r["file"]).exists() else None
    for r in rows:
        r["skipped"] = r["name"] in skip
    (a.out / "missing.json").write_text(json.dumps(rows, indent=1) + "\n")
    total = sum(r.get("bytes") or 0 for r in rows if not r["skipped"])
    for r in rows:
        print(f"{r['name']:40s} {r['version']:16s} {'skip' if r['skipped'] else (r.get('bytes') or '')}")
    print(f"{len(rows)} packages beyond the image, {sum(not r['skipped'] for r in rows)} carried, {total / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
