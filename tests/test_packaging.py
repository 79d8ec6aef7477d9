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


def test_ci_runs_the_readme_commands_and_the_numerics_on_avx2():
    """.ci/run installs and tests as the README says, then repeats the float64 checks on AVX2 kernels."""
    import re

    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    install = re.search(r"pip install (torch==\S+ torchvision==\S+)", readme).group(1)
    assert f"pip install -q {install}" in ci and 'pip install -q -e ".[test]"' in ci
    assert re.search(r"^python -m pytest tests$", ci, re.M)
    assert ". .venv/bin/activate && python -m pytest tests" in readme
    avx2 = re.search(r"^ATEN_CPU_CAPABILITY=avx2 python -m pytest (.+?) -k", ci, re.M | re.S).group(1)
    files = avx2.replace("\\\n", " ").split()
    assert all((ROOT / f).is_file() for f in files) and "tests/test_recurrent_baselines.py" in files
