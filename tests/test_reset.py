"""reset archives, never deletes; a regenerate after a dataset reset sends that dataset again only."""

from __future__ import annotations

import json
import subprocess
import sys

from specops.testing.fake_server import start_fake_server


def test_reset_dataset_archives_and_regenerates(tmp_path):
    for name in ("a", "b"):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps({"id": f"{name}{i}", "prompt": f"q{i}"}) + "\n"
                                                        for i in range(5)))
    with start_fake_server(tmp_path / "srv", model="m") as srv:
        cfg = tmp_path / "c.toml"
        cfg.write_text(
            f'[campaign]\nname = "r"\ndir = "{tmp_path / "camp"}"\n[target]\nserved_name = "m"\n'
            f'[engine]\nkind = "openai"\nendpoints = ["{srv.url}"]\n[generate]\ncanary_samples = 0\n'
            f'[[datasets]]\nname = "a"\npath = "{tmp_path / "a.jsonl"}"\n'
            f'[[datasets]]\nname = "b"\npath = "{tmp_path / "b.jsonl"}"\n')
        run = lambda *a: subprocess.run([sys.executable, "-m", "specops", *a], capture_output=True, text=True,  # noqa: E731
                                        timeout=120)
        assert run("generate", str(cfg), "--no-progress").returncode == 0
        before = (tmp_path / "camp" / "generate" / "a" / "records.jsonl").read_bytes()
        out = run("reset", "generate", str(cfg), "--dataset", "a")
        assert out.returncode == 0, out.stderr
        archived = list((tmp_path / "camp" / "archive").glob("generate-a-*/generate/a/records.jsonl"))
        assert len(archived) == 1 and archived[0].read_bytes() == before  # moved, not deleted
        assert not (tmp_path / "camp" / "generate" / "a").exists()
        m = json.loads((tmp_path / "camp" / "manifest.json").read_text())
        assert m["phases"]["generate"]["state"] == "pending" and m["phases"]["eval"]["state"] == "pending"
        n = len(srv.requests())
        assert run("generate", str(cfg), "--no-progress").returncode == 0
        again = [r["sample"] for r in srv.requests()[n:] if r["sample"] != "specops-health-probe"]
        assert sorted(again) == [f"a/a{i}" for i in range(5)]  # only the reset dataset is sent again
        bad = run("reset", "nonsense", str(cfg))
        assert bad.returncode == 2 and "unknown phase" in bad.stderr
