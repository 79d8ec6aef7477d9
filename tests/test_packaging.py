"""Every package directory is listed in pyproject.toml, so a normal (non-editable) install has it."""

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_all_packages_are_listed():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(cfg["packages"])
    found = {".".join(p.parent.relative_to(ROOT / "src").parts) for p in (ROOT / "src" / "mixlab").rglob("__init__.py")}
    found |= {"mixlab." + ".".join(p.parent.relative_to(ROOT).parts)
              for p in (ROOT / "datamodules").rglob("__init__.py")}
    assert found <= listed, f"add to [tool.setuptools] packages in pyproject.toml: {sorted(found - listed)}"
    assert cfg["package-dir"]["mixlab.datamodules"] == "datamodules"


def test_shipped_data_is_package_data():
    from importlib.resources import files

    data = files("mixlab") / "data"
    for name in ["human_chr22_hg38_slice.fa", "human_chr17_hg19_part.fa", "human_chrM_rCRS.fa",
                 "tinyshakespeare.txt", "gpt2.tiktoken", "uci_digits.csv.gz", "SOURCES.md"]:
        assert (data / name).is_file(), name
    assert "CC BY 4.0" in (data / "SOURCES.md").read_text()
