"""The onnxruntime encoder backend: the torch model's embeddings and results, an export made once, clear errors."""
import logging

import numpy as np
import pytest

from megatron_searchr1.search import onnx_encoder
from megatron_searchr1.search.dense import DenseRetriever
from megatron_searchr1.search.encoder import Encoder, EncoderConfig

pytestmark = pytest.mark.skipif(onnx_encoder.available() is not None, reason="onnxruntime/onnx not installed")


@pytest.fixture(scope="module")
def encoders():
    return Encoder(EncoderConfig(backend="torch")), Encoder(EncoderConfig(backend="onnxruntime"))


def test_onnx_embeddings_and_top3_equal_the_torch_models(encoders, world, dense_index):
    torch_enc, onnx_enc = encoders
    assert (torch_enc.backend, onnx_enc.backend) == ("torch", "onnxruntime")
    passages = [f"{d['title']}\n{d['text']}" for d in world["docs"][:80]]  # padded batches of varied lengths
    for texts, is_query in ((world["queries"], True), (passages, False), (passages[:1], False)):
        np.testing.assert_allclose(onnx_enc.encode(texts, is_query), torch_enc.encode(texts, is_query), atol=1e-5)
    index = dense_index[1].cpu_index
    ids_torch, _ = DenseRetriever(dense_index[1].corpus, index, torch_enc).search_ids(world["queries"], 3)
    ids_onnx, _ = DenseRetriever(dense_index[1].corpus, index, onnx_enc).search_ids(world["queries"], 3)
    np.testing.assert_array_equal(ids_onnx, ids_torch)


def test_the_export_is_cached_and_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGATRON_SEARCHR1_CACHE", str(tmp_path))
    first = Encoder(EncoderConfig(backend="onnxruntime"))
    files = list((tmp_path / "onnx").glob("*.onnx"))
    assert len(files) == 1 and first._onnx.path == str(files[0])
    monkeypatch.setattr(onnx_encoder, "export", lambda *a: pytest.fail("exported again"))
    again = Encoder(EncoderConfig(backend="onnxruntime"))
    np.testing.assert_array_equal(again.encode(["a query"], True), first.encode(["a query"], True))


def test_a_missing_runtime_fails_when_asked_for_and_falls_back_to_torch_on_auto(monkeypatch, caplog):
    why = "the onnxruntime encoder backend needs the `onnxruntime` package: bash tools/install.sh"
    monkeypatch.setattr(onnx_encoder, "available", lambda: why)
    with pytest.raises(ImportError, match="tools/install.sh"):
        Encoder(EncoderConfig(backend="onnxruntime"))
    with caplog.at_level(logging.WARNING):
        assert Encoder(EncoderConfig(backend="auto")).backend == "torch"
    assert why in caplog.text


def test_an_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="backend must be one of auto, torch, onnxruntime"):
        EncoderConfig(backend="tensorrt")


@pytest.mark.parametrize("module", ["server", "build_index"])
def test_the_clis_refuse_onnxruntime_on_a_gpu_device_before_loading_anything(module, world, dense_index, tmp_path):
    import importlib

    from megatron_searchr1.cli import UsageError

    main = importlib.import_module(f"megatron_searchr1.search.{module}").main
    where = ["--index-dir", dense_index[0]] if module == "server" else \
        ["--corpus", world["path"], "--out-dir", str(tmp_path / "i"), "--kind", "dense"]
    with pytest.raises(UsageError, match="onnxruntime runs on the CPU, not --device cuda"):
        main([*where, "--encoder-backend", "onnxruntime", "--device", "cuda"])
    assert not (tmp_path / "i").exists()
