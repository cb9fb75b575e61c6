"""What the torch engine keeps resident: KV caches where written, codec tables without their sums.

Residency is read from ``/proc/self/status`` (Linux): allocations of hundreds of MB whose pages are
or are not touched, far apart from any noise of the test process itself.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from s2s_daemon.tts.engine import EngineOptions, SynthesisRequest  # noqa: E402
from s2s_daemon.tts.torch_qwen3 import TorchQwen3Engine, layers  # noqa: E402
from s2s_daemon.tts.torch_qwen3.config import DecoderConfig  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.usefixtures("torch_one_thread")]

CV = Path(__file__).parent / "fixtures" / "qwen3_tiny" / "custom_voice"
LINUX = pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="reads /proc/self/status (Linux)")
REQUEST = SynthesisRequest(text="Hello there, this is a test.", voice="Ryan", language="english", greedy=True)


def _anon_mib() -> float:
    with open("/proc/self/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no RssAnon in /proc/self/status")


def _resident_kib(path: Path) -> int:
    """KiB of ``path``'s mappings resident in this process (``/proc/self/smaps``)."""
    real, total, inside = str(path.resolve()), 0, False
    with open("/proc/self/smaps", encoding="ascii", errors="replace") as fh:
        for line in fh:
            head = line.split()
            if "-" in head[0] and not head[0].endswith(":"):
                inside = len(head) > 5 and head[5] == real
            elif inside and head[0] == "Rss:":
                total += int(head[1])
    return total


@LINUX
def test_a_cpu_kv_cache_is_resident_only_where_written() -> None:
    """The released talker's shapes, 2048 positions: 470 MB of keys and values, of which a
    64-position utterance writes 15."""
    talker = DecoderConfig(
        hidden_size=1024, intermediate_size=3072, num_layers=28, num_heads=16, num_kv_heads=8, head_dim=128,
        rms_norm_eps=1e-6, rope_theta=1e6, attention_bias=False, vocab_size=3072,
    )  # fmt: skip
    before = _anon_mib()
    cache = layers.KVCache(talker, 2048, torch.device("cpu"), torch.float32)
    assert cache.k.numel() * 4 * 2 > 400 << 20
    cache.k[:, :, :, :64] = 1.0
    cache.v[:, :, :, :64] = 1.0
    grown = _anon_mib() - before
    assert grown < 64, f"{grown:.0f} MiB resident for 15 MiB written"


@pytest.fixture
def poisoned_caches(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every KV cache made filled with NaN, as unwritten memory may hold."""
    made = layers.KVCache.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        made(self, *args, **kwargs)
        self.k.fill_(float("nan"))
        self.v.fill_(float("nan"))

    monkeypatch.setattr(layers.KVCache, "__init__", init)
    yield


def _codes(kernels: str, quantization: str, batched: bool) -> Any:
    options = EngineOptions(model=str(CV), device="cpu", dtype="float32", quantization=quantization,
                            kernels=kernels, extra={"prepared_cache": "0"})  # fmt: skip
    engine = TorchQwen3Engine(options)
    engine.load_blocking()
    try:
        if not batched:
            return [engine.codes_blocking(REQUEST, max_frames=6) for _ in range(2)]  # the second from a kept prefix
        assert engine.runtime is not None and engine.gen is not None
        rows = []
        with torch.inference_mode():
            prompt, _, _, _ = engine.prepare(REQUEST)
            from s2s_daemon.tts.torch_qwen3.runtime import DecodeOptions

            seqs = [engine.runtime.start(prompt, DecodeOptions(6, True, None)) for _ in range(2)]
            while not all(s.done for s in seqs):
                rows.append([None if r is None else r.clone() for r in engine.runtime.step_batch(seqs, engine.gen)])
        return rows
    finally:
        engine.close_blocking()


@pytest.mark.parametrize(
    ("kernels", "quantization", "batched"),
    [("torch", "none", False), ("native", "int8", False), ("native", "int8", True)],
)
def test_no_reader_sees_an_unwritten_cache_position(kernels: str, quantization: str, batched: bool,
                                                   request: pytest.FixtureRequest) -> None:  # fmt: skip
    clean = _codes(kernels, quantization, batched)
    request.getfixturevalue("poisoned_caches")
    poisoned = _codes(kernels, quantization, batched)
    assert len(clean) == len(poisoned)
    for a, b in zip(clean, poisoned, strict=True):
        if isinstance(a, list):
            assert all((x is None and y is None) or torch.equal(x, y) for x, y in zip(a, b, strict=True))
        else:
            assert torch.equal(a, b)


def test_codebook_rows_are_read_from_the_file_when_looked_up() -> None:
    """On the CPU the decoder keeps no codebook table: each looked-up row is read from the file's
    stored sums and divided by its usage, the values the table holds; nothing of the file stays
    resident. Where tables are computed (other devices), the sums are not kept beside them."""
    from safetensors.torch import load_file

    from s2s_daemon.tts.torch_qwen3.codec import CodecDecoder, _Codebook

    decoder = CodecDecoder.from_folder(CV / "speech_tokenizer")
    books = [m for m in decoder.modules() if isinstance(m, _Codebook)]
    assert books and all(book.rows_from is not None and book._table is None for book in books)
    assert decoder.stream().push(torch.randint(0, 64, (3, 16))).abs().sum() > 0
    assert _resident_kib(CV / "speech_tokenizer" / "model.safetensors") == 0  # before load_file maps it whole
    stored = load_file(str(CV / "speech_tokenizer" / "model.safetensors"))
    key = "decoder.quantizer.rvq_first.vq.layers.0._codebook"
    raw = _Codebook(*books[0].embedding_sum.shape)
    raw.embedding_sum.data = stored[f"{key}.embedding_sum"].float()  # as loaded in the decoder's dtype
    raw.cluster_usage.data = stored[f"{key}.cluster_usage"].float()
    codes = torch.tensor([[0, 5, raw.embedding_sum.shape[0] - 1, 5]])
    looked_up = books[0].lookup(codes)
    assert looked_up.dtype == torch.float32
    assert torch.equal(looked_up, torch.nn.functional.embedding(codes, raw.table()))

    raw.compact()  # the path of a decoder on another device
    assert raw.embedding_sum.data_ptr() == raw.table().data_ptr()  # one tensor, not two
    assert torch.equal(raw.cluster_usage, torch.ones_like(raw.cluster_usage))
    assert torch.equal(raw.lookup(codes), looked_up) and raw.table().grad_fn is None


@pytest.mark.skipif(not Path("/proc/self/smaps").is_file(), reason="reads /proc/self/smaps (Linux)")
def test_the_decoder_keeps_nothing_of_its_file_resident() -> None:
    """A view of a small tensor (a bias, a norm) would keep up to 64 KiB of the file around it
    resident (the kernel's fault-around): the decoder reads those into buffers of its own, and its
    codebooks' rows when looked up."""
    from s2s_daemon.tts.torch_qwen3 import codec

    path = CV / "speech_tokenizer" / "model.safetensors"
    # in the fixture's stored dtype, so that tensors used as stored are not cast (a cast is a read)
    decoder = codec.CodecDecoder.from_folder(CV / "speech_tokenizer", dtype=torch.bfloat16)
    small = [t for t in decoder.parameters() if t.numel() * t.element_size() < codec.VIEW_MIN_BYTES]
    assert small
    assert decoder.stream().push(torch.randint(0, 64, (3, 16))).abs().sum() > 0
    assert _resident_kib(path) == 0


@pytest.mark.skipif(not Path("/proc/self/smaps").is_file(), reason="reads /proc/self/smaps (Linux)")
@pytest.mark.parametrize(("kernels", "quantization"), [("torch", "none"), ("native", "int8")])
def test_lookups_leave_nothing_of_the_checkpoint_resident(kernels: str, quantization: str) -> None:
    """The text and codec tables are read row by row from the file, never through its mapping:
    a mapped lookup kept 64 KiB around every row looked up (the kernel's fault-around), and over a
    daemon's life every row of every token it saw."""
    from s2s_daemon.tts.torch_qwen3.talker import LookupTable

    options = EngineOptions(model=str(CV), device="cpu", dtype="float32", quantization=quantization,
                            kernels=kernels, extra={"prepared_cache": "0"})  # fmt: skip
    engine = TorchQwen3Engine(options)
    engine.load_blocking()
    try:
        assert engine.runtime is not None
        tables = [m for m in engine.runtime.talker.modules() if isinstance(m, LookupTable)]
        assert len(tables) == 17 and all(t.rows_from is not None for t in tables)
        engine.codes_blocking(REQUEST, max_frames=6)
        assert _resident_kib(CV / "model.safetensors") == 0
    finally:
        engine.close_blocking()


def test_rows_read_from_the_file_are_the_tables_rows(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    from s2s_daemon.tts.torch_qwen3.checkpoint import FileRows, TensorFiles

    tables = {"a": torch.randn(50, 24).to(torch.bfloat16), "b": torch.randn(7, 40)}
    save_file(tables, str(tmp_path / "t.safetensors"))
    files = TensorFiles([tmp_path / "t.safetensors"])
    ids = torch.tensor([[3, 0, 49], [49, 3, 1]])
    got = files.rows("a").take(ids)
    assert got.dtype == torch.bfloat16 and torch.equal(got, torch.nn.functional.embedding(ids, tables["a"]))
    assert torch.equal(files.rows("b").take(torch.tensor([6, 0])), tables["b"][[6, 0]])
    assert files.rows("b").take(torch.tensor([], dtype=torch.long)).shape == (0, 40)
    with pytest.raises(IndexError, match="row 7 is out of range"):
        files.rows("b").take(torch.tensor([7]))
    with pytest.raises(ValueError, match="two dimensions"):
        FileRows(tmp_path / "t.safetensors", 0, (5,), torch.float32)
