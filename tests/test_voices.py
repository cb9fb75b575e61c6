"""The voice library: names and paths refused, clone prompts cached in memory and on disk, the
``voices`` command, and a library voice spoken through MQTT by the torch engine (tiny checkpoints)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from s2s_daemon.cli import main
from s2s_daemon.errors import EXIT_USAGE
from s2s_daemon.intake.admission import IntakeRules
from s2s_daemon.intake.schemas import parse_say
from s2s_daemon.pipeline.vocabulary import UnknownVoiceError
from s2s_daemon.pipeline.voice_policy import VoicePolicy
from s2s_daemon.pipeline.voices import VoiceKind, VoiceLibrary, default_cache_dir, default_voices_dir

FIXTURES = Path(__file__).parent / "fixtures" / "qwen3_tiny"
BASE = FIXTURES / "base"
VD = FIXTURES / "voice_design"
REF_WAV = FIXTURES / "golden" / "ref_espeak_24k.wav"
REF_TEXT = "Good morning. This is a reference recording for voice cloning."
TEXT = "Hello there, this is a test."


def _voice(root: Path, name: str, ref_text: str | None = REF_TEXT, instruct: str | None = None) -> Path:
    folder = root / name
    folder.mkdir(parents=True)
    if instruct is None:
        shutil.copy(REF_WAV, folder / "ref.wav")
    else:
        (folder / "instruct.txt").write_text(instruct, encoding="utf-8")
    if ref_text is not None and instruct is None:
        (folder / "ref.txt").write_text(ref_text, encoding="utf-8")
    return folder


def _rules(library: VoiceLibrary, voices: tuple[str, ...] = ()) -> IntakeRules:
    return IntakeRules("kitchen", 2000, VoicePolicy(voices, None, library), ("auto", "english"), "auto")


def _say(rules: IntakeRules, voice: str) -> tuple[str | None, str | None]:
    parsed = parse_say(json.dumps({"text": "hi", "voice": voice}).encode(), rules)
    return parsed.request.voice, (str(parsed.error.code) if parsed.error else None)


# -- names and paths --------------------------------------------------------------------


def test_default_folders_follow_xdg(tmp_path: Path) -> None:
    env = {"XDG_DATA_HOME": str(tmp_path / "d"), "XDG_CACHE_HOME": str(tmp_path / "c")}
    assert default_voices_dir(env) == tmp_path / "d" / "s2s-daemon" / "voices"
    assert default_cache_dir(env) == tmp_path / "c" / "s2s-daemon" / "voices"
    assert default_voices_dir({}) == Path.home() / ".local" / "share" / "s2s-daemon" / "voices"


def test_a_library_voice_is_found_by_name_in_any_case(tmp_path: Path) -> None:
    _voice(tmp_path, "Alice")
    rules = _rules(VoiceLibrary(tmp_path, "base"))
    assert _say(rules, "alice") == ("Alice", None)
    assert _say(rules, "Nobody") == (None, "unknown_voice")
    assert VoiceLibrary(tmp_path, "base").names() == {"Alice": VoiceKind.CLONE}


def test_paths_and_symlinks_out_of_the_folder_are_unknown_voices(tmp_path: Path) -> None:
    root, outside = tmp_path / "voices", tmp_path / "outside"
    _voice(root, "good")
    _voice(outside, "stolen")
    (root / "linked").symlink_to(outside / "stolen", target_is_directory=True)  # a folder leading out
    (root / "sneaky").mkdir()
    (root / "sneaky" / "ref.wav").symlink_to(outside / "stolen" / "ref.wav")  # a file leading out
    (root / "inside").mkdir()
    (root / "inside" / "ref.wav").symlink_to(root / "good" / "ref.wav")  # a link within is fine
    rules = _rules(VoiceLibrary(root, "base"))
    for name in ("../../etc/passwd", "/etc/passwd", str(outside / "stolen"), "../outside/stolen", "linked", "sneaky"):
        assert _say(rules, name) == (None, "unknown_voice"), name
    assert _say(rules, "inside") == ("inside", None)
    assert set(VoiceLibrary(root, "base").names()) == {"good", "inside"}


def test_a_voice_of_the_wrong_kind_is_unknown_with_a_reason(tmp_path: Path) -> None:
    _voice(tmp_path, "narrator", instruct="A deep, calm voice.")
    _voice(tmp_path, "alice")
    parsed = parse_say(b'{"text": "hi", "voice": "narrator"}', _rules(VoiceLibrary(tmp_path, "base")))
    assert parsed.error is not None and str(parsed.error.code) == "unknown_voice"
    assert "ref.wav" in parsed.error.message
    design = _rules(VoiceLibrary(tmp_path, "voice_design"))
    assert _say(design, "narrator") == ("narrator", None)
    assert _say(design, "alice") == (None, "unknown_voice")
    # A preset speaker wins a clash of names; a CustomVoice model speaks no library voice.
    presets = _rules(VoiceLibrary(tmp_path, "custom_voice"), ("Ryan",))
    assert _say(presets, "ryan") == ("Ryan", None)
    assert _say(presets, "alice") == (None, "unknown_voice")


def test_the_voice_policy_answers_every_door_alike(tmp_path: Path) -> None:
    """What a name means (pipeline/voice_policy.py), as the speech API, its voice lists, Wyoming's
    info and the MQTT info event read it: one policy, every question."""
    _voice(tmp_path, "alice")
    _voice(tmp_path, "Ryan")  # shadowed by the preset speaker of that name
    _voice(tmp_path, "narrator", instruct="A deep, calm voice.")  # a kind a Base model cannot speak
    base = VoicePolicy((), "alice", VoiceLibrary(tmp_path, "base"))
    assert base.resolve(None) == "alice" and base.resolve(" ALICE ") == "alice" and base.default_voice() == "alice"
    assert base.library_voices() == {"alice": VoiceKind.CLONE, "Ryan": VoiceKind.CLONE}
    assert base.from_openai("alloy") is None  # OpenAI's name: the default voice
    assert base.from_openai("alice") == "alice"
    assert base.is_ours("narrator") and not base.is_ours("nobody")
    with pytest.raises(UnknownVoiceError, match="narrator"):
        base.resolve("narrator")
    presets = VoicePolicy(("Ryan", "Vivian"), "Vivian", VoiceLibrary(tmp_path, "custom_voice"))
    assert presets.resolve(None) == "Vivian" and presets.resolve("ryan") == "Ryan"
    assert presets.library_voices() == {} and presets.kinds() == {"Ryan": "preset", "Vivian": "preset"}
    # A Base model with no voice to default to: a request must name one, and is told why.
    bare = VoicePolicy((), None, VoiceLibrary(tmp_path / "empty", "base"), no_default="name a library voice")
    assert bare.default_voice() is None
    with pytest.raises(UnknownVoiceError, match="name a library voice"):
        bare.resolve("  ")
    # An OpenAI name that is one of ours is ours.
    _voice(tmp_path, "nova")
    assert base.from_openai("Nova") == "Nova" and base.resolve("Nova") == "nova"


# -- the voices command -----------------------------------------------------------------


def test_voices_add_list_remove(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    soundfile = pytest.importorskip("soundfile")
    audio, rate = soundfile.read(str(REF_WAV), dtype="float32")
    flac = tmp_path / "me.flac"  # another format, rate and channel count than the library keeps
    soundfile.write(str(flac), np.stack([audio, audio], axis=1)[::3], rate // 3, format="FLAC")
    root = tmp_path / "voices"
    base = ["voices"]
    assert main([*base, "add", "bob", "--ref-audio", str(flac), "--ref-text", REF_TEXT, "--dir", str(root)]) == 0
    info = soundfile.info(str(root / "bob" / "ref.wav"))
    assert (info.samplerate, info.channels, info.subtype) == (24000, 1, "PCM_16")
    assert abs(info.duration - len(audio) / rate) < 0.01
    assert (root / "bob" / "ref.txt").read_text(encoding="utf-8").strip() == REF_TEXT
    assert main([*base, "add", "bob", "--ref-audio", str(flac), "--dir", str(root)]) != 0  # exists
    short = tmp_path / "short.wav"
    soundfile.write(str(short), audio[: rate // 2], rate)
    assert main([*base, "add", "tiny", "--ref-audio", str(short), "--dir", str(root)]) == 65  # 0.5 s
    assert main([*base, "add", "../evil", "--instruct", "x", "--dir", str(root)]) == 64
    silent = tmp_path / "silent.wav"
    soundfile.write(str(silent), np.zeros(rate * 4, dtype=np.float32), rate)
    capsys.readouterr()
    assert main([*base, "add", "quiet", "--ref-audio", str(silent), "--dir", str(root)]) == 65  # no voice to clone
    assert "silent" in capsys.readouterr().err and not (root / "quiet").exists()
    assert main([*base, "add", "quiet", "--ref-audio", str(silent), "--dir", str(root), "--force"]) == 0
    assert "silent" in capsys.readouterr().err
    assert main([*base, "add", "narrator", "--instruct", "A deep, calm voice.", "--dir", str(root)]) == 0
    assert main([*base, "list", "--dir", str(root)]) == 0
    listed = capsys.readouterr().out
    assert "bob\tclone, 3.9 s, with transcript" in listed and "narrator\tdesign" in listed
    assert main([*base, "remove", "bob", "--dir", str(root)]) == 0
    assert not (root / "bob").exists() and (root / "narrator").is_dir()
    assert main([*base, "remove", "bob", "--dir", str(root)]) != 0


def test_voices_add_says_what_is_wrong_with_the_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A missing file is no "System error", a file that is no recording is no "invalid
    configuration" (exit 78), and a voice the configured model cannot speak gets a hint."""
    monkeypatch.delenv("S2S_CONFIG", raising=False)
    root = tmp_path / "voices"
    capsys.readouterr()
    assert main(["voices", "add", "x", "--ref-audio", str(tmp_path / "nope.wav"), "--dir", str(root)]) == 66
    err = capsys.readouterr().err
    assert "nope.wav: No such file or directory" in err and "System error" not in err
    garbage = tmp_path / "garbage.wav"
    garbage.write_text("not audio")
    assert main(["voices", "add", "x", "--ref-audio", str(garbage), "--dir", str(root)]) == 65
    assert "not a recording this can read" in capsys.readouterr().err
    monkeypatch.setenv("S2S_TTS__MODEL", str(FIXTURES / "custom_voice"))
    assert main(["voices", "add", "bob", "--ref-audio", str(REF_WAV), "--dir", str(root)]) == 0
    assert "is a custom_voice model: it cannot speak a clone voice; a Base model" in capsys.readouterr().err
    monkeypatch.setenv("S2S_TTS__MODEL", str(BASE))
    assert main(["voices", "add", "carol", "--ref-audio", str(REF_WAV), "--dir", str(root)]) == 0
    assert "note:" not in capsys.readouterr().err
    monkeypatch.setenv("S2S_TTS__MODEL", "Qwen/Qwen3-TTS-12Hz-0.6B-Base")
    assert main(["voices", "add", "narrator", "--instruct", "A deep voice.", "--dir", str(root)]) == 0
    assert "it cannot speak a design voice; a VoiceDesign model" in capsys.readouterr().err


def test_voices_rename_and_names_that_differ_only_in_case(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "voices"
    base = ["voices"]
    assert main([*base, "add", "bob", "--instruct", "A calm voice.", "--dir", str(root)]) == 0
    assert main([*base, "add", "carol", "--instruct", "A bright voice.", "--dir", str(root)]) == 0
    # Requests match names in any case: a second voice called Bob could not be told from bob.
    capsys.readouterr()
    assert (
        main([*base, "add", "Bob", "--instruct", "Another.", "--dir", str(root)]) == EXIT_USAGE
    )  # taken: a usage error
    assert "as 'bob'" in capsys.readouterr().err
    assert main([*base, "rename", "bob", "Carol", "--dir", str(root)]) != 0  # carol's, in another case
    assert "as 'carol'" in capsys.readouterr().err
    assert main([*base, "rename", "bob", "../evil", "--dir", str(root)]) != 0
    assert main([*base, "rename", "nobody", "dave", "--dir", str(root)]) != 0
    assert main([*base, "rename", "bob", "Bob", "--dir", str(root)]) == 0  # its own name in another case
    assert main([*base, "rename", "Bob", "dave", "--dir", str(root)]) == 0
    assert sorted(p.name for p in root.iterdir()) == ["carol", "dave"]
    assert (root / "dave" / "instruct.txt").read_text(encoding="utf-8").strip() == "A calm voice."


# -- the torch engine: clone prompts computed once --------------------------------------


@pytest.fixture
def one_thread() -> Iterator[None]:
    torch = pytest.importorskip("torch")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _engine(path: Path, cache: Path | str) -> Any:
    from s2s_daemon.tts.engine import EngineOptions
    from s2s_daemon.tts.torch_qwen3 import TorchQwen3Engine

    options = EngineOptions(
        model=str(path), device="cpu", dtype="float32", kernels="torch", extra={"voice_cache": str(cache)}
    )
    engine = TorchQwen3Engine(options)
    engine.load_blocking()
    return engine


class _Counted:
    """Counts the encoder calls of an engine."""

    def __init__(self, engine: Any, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[str] = []
        for attr, method in (("speaker_encoder", "embed"), ("speech_encoder", "encode")):
            encoder = getattr(engine, attr)
            real = getattr(encoder, method)

            def counted(*args: Any, _real: Any = real, _name: str = attr, **kwargs: Any) -> Any:
                self.calls.append(_name)
                return _real(*args, **kwargs)

            monkeypatch.setattr(encoder, method, counted)


@pytest.mark.slow
@pytest.mark.torch
@pytest.mark.timeout(300)
@pytest.mark.parametrize("ref_text", [REF_TEXT, None], ids=["icl", "xvector"])
def test_clone_prompt_is_cached_in_memory_and_on_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, one_thread: None, ref_text: str | None
) -> None:
    from s2s_daemon.tts.engine import SynthesisRequest

    torch = pytest.importorskip("torch")
    folder = _voice(tmp_path / "voices", "alice", ref_text=ref_text)
    cache = tmp_path / "cache"
    request = SynthesisRequest(
        text=TEXT, voice=None, language="english", greedy=True, ref_audio=str(folder / "ref.wav"), ref_text=ref_text
    )
    uncached = _engine(BASE, "off")
    expected = uncached.codes_blocking(request, max_frames=6)
    uncached.close_blocking()

    first = _engine(BASE, cache)
    counted = _Counted(first, monkeypatch)
    assert torch.equal(first.codes_blocking(request, max_frames=6), expected)
    encoders = ["speaker_encoder", "speech_encoder"] if ref_text else ["speaker_encoder"]
    assert counted.calls == encoders
    assert torch.equal(first.codes_blocking(request, max_frames=6), expected)  # memory
    assert counted.calls == encoders and len(list(cache.glob("*.safetensors"))) == 1
    first.close_blocking()

    restarted = _engine(BASE, cache)
    counted = _Counted(restarted, monkeypatch)
    assert torch.equal(restarted.codes_blocking(request, max_frames=6), expected)  # disk
    assert counted.calls == [] and restarted.clone_prompts.loaded == 1

    # A changed recording is noticed by its hash (same name, same size).
    audio = np.frombuffer((folder / "ref.wav").read_bytes()[44:], dtype="<i2").copy()
    raw = (folder / "ref.wav").read_bytes()[:44] + (audio // 2).astype("<i2").tobytes()
    (folder / "ref.wav").write_bytes(raw)
    os.utime(folder / "ref.wav", ns=(1, 1))
    restarted.codes_blocking(request, max_frames=2)
    assert counted.calls == encoders and len(list(cache.glob("*.safetensors"))) == 2
    restarted.close_blocking()


@pytest.mark.torch
@pytest.mark.timeout(300)
def test_a_designed_voice_speaks_its_instruction(tmp_path: Path, one_thread: None) -> None:
    from s2s_daemon.pipeline.channel import Channel, Overflow
    from s2s_daemon.pipeline.jobs import Ledger
    from s2s_daemon.pipeline.queue import RequestQueue
    from s2s_daemon.say import LogEvents
    from s2s_daemon.tts.engine import SynthesisRequest
    from s2s_daemon.tts.stage import TtsStage
    from s2s_daemon.tts.worker import EngineWorker

    torch = pytest.importorskip("torch")
    _voice(tmp_path, "narrator", instruct="A deep, calm voice.")
    engine = _engine(VD, "off")
    info = engine.info
    requests = RequestQueue(4)
    stage = TtsStage(
        EngineWorker(engine),
        info,
        requests,
        Channel(1, Overflow.BLOCK, "u"),
        Ledger(requests, LogEvents(), 16),
        4,
        library=VoiceLibrary(tmp_path, info.mode),
    )
    rules = _rules(VoiceLibrary(tmp_path, info.mode))
    parsed = parse_say(b'{"text": "Hello there.", "voice": "NARRATOR", "language": "en"}', rules)
    assert parsed.error is None and parsed.request.voice == "narrator"
    plain = SynthesisRequest(text="Hello there.", voice="narrator", language="english", greedy=True)
    pins = contextlib.ExitStack()  # a designed voice pins no recording
    synth = stage._with_library_voice(plain, "narrator", pins)
    assert synth.voice is None and synth.instruct == "A deep, calm voice."
    (tmp_path / "narrator" / "voice.yaml").write_text("language: en\ndescription: for stories\n", encoding="utf-8")
    auto = stage._with_library_voice(dataclasses.replace(plain, language="auto", instruct="Slowly."), "narrator", pins)
    assert auto.language == "english" and auto.instruct == "A deep, calm voice. Slowly."
    direct = SynthesisRequest(
        text="Hello there.", voice=None, language="english", instruct="A deep, calm voice.", greedy=True
    )
    assert torch.equal(engine.codes_blocking(synth, max_frames=4), engine.codes_blocking(direct, max_frames=4))
    engine.close_blocking()


# -- MQTT, the daemon in process ----------------------------------------------------------


@pytest.mark.integration
@pytest.mark.torch
@pytest.mark.timeout(300)
async def test_mqtt_say_speaks_a_library_voice(tmp_path: Path, mosquitto: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from s2s_daemon.events import publisher
    from tests.support.daemon import daemon_in_process, write_config
    from tests.support.mqtt import recorder

    root = tmp_path / "voices"
    _voice(root, "alice")
    broken = _voice(root, "broken")
    (broken / "ref.wav").write_bytes(b"RIFF not really a wav file")
    config = write_config(
        tmp_path / "d.yaml",
        mosquitto.port,
        tts={
            "engine": "torch",
            "model": str(BASE),
            "voices_dir": str(root),
            "warmup": False,
            "chunk_frames": 2,
            "options": {"max_frames": "3", "voice_cache": str(tmp_path / "cache")},
        },
    )
    say = "s2s/kitchen/tts/say"
    async with recorder(mosquitto.port) as rec, daemon_in_process(config):
        await rec.wait_for(lambda: rec.on("/info") and any(m.payload == b"online" for m in rec.on("/status")), 240)
        info = rec.payloads("/info")[-1]
        assert info["voices"] == [] and info["voiceKinds"] == {"alice": "clone", "broken": "clone"}
        await rec.say(say, {"id": "a1", "text": "Hello from the kitchen.", "voice": "Alice", "language": "en"})
        await rec.say(say, {"id": "b1", "text": "Hello.", "voice": "broken"})
        await rec.say(say, {"id": "p1", "text": "Hello.", "voice": "../../etc/passwd"})
        await rec.say(say, {"id": "a2", "text": "Hello again.", "voice": "alice"})
        fin = await rec.wait_finished(["a1", "b1", "p1", "a2"], timeout_s=180)
        # A voice added while the daemon runs is spoken, and info is published again with it.
        _voice(root, "carol", ref_text=None)
        monkeypatch.setattr(publisher, "INFO_RESCAN_S", 0.0)  # rescanned at the next request, however soon
        await rec.say(say, {"id": "c1", "text": "Hello.", "voice": "carol"})
        fin.update(await rec.wait_finished(["c1"], timeout_s=120))
        kinds = await rec.wait_for(lambda: next((p for p in rec.payloads("/info") if "carol" in p["voiceKinds"]), None))
        assert kinds["voiceKinds"] == {"alice": "clone", "broken": "clone", "carol": "clone"}
    assert fin["a1"]["status"] == "completed", fin["a1"]
    assert fin["a2"]["status"] == "completed", fin["a2"]
    assert fin["p1"]["error"]["code"] == "unknown_voice"
    assert fin["b1"]["status"] == "error" and "'broken'" in fin["b1"]["error"]["message"], fin["b1"]
    assert fin["c1"]["status"] == "completed", fin["c1"]
    assert len(list((tmp_path / "cache").glob("*.safetensors"))) == 2  # alice (ICL), carol (x-vector)


@pytest.mark.slow
@pytest.mark.torch
@pytest.mark.timeout(300)
def test_say_command_speaks_a_library_voice(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, one_thread: None) -> None:
    import wave

    root = tmp_path / "voices"
    _voice(root, "alice")
    for key, value in {
        "S2S_TTS__VOICES_DIR": str(root),
        "S2S_TTS__WARMUP": "false",
        "S2S_TTS__OPTIONS__MAX_FRAMES": "3",
        "S2S_TTS__OPTIONS__VOICE_CACHE": str(tmp_path / "cache"),
    }.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("S2S_CONFIG", raising=False)
    out = tmp_path / "out.wav"
    assert main(["say", "Hello there.", "--model", str(BASE), "--voice", "ALICE", "--out", str(out), "--greedy"]) == 0
    with wave.open(str(out)) as wav:
        assert wav.getframerate() == 24000 and wav.getnframes() > 0
    assert len(list((tmp_path / "cache").glob("*.safetensors"))) == 1
    assert main(["say", "Hello.", "--model", str(BASE), "--voice", "nobody", "--out", str(out)]) != 0


def test_wyoming_describe_lists_library_voices(tmp_path: Path) -> None:
    pytest.importorskip("wyoming")
    from s2s_daemon.intake.wyoming import describe
    from s2s_daemon.pipeline.vocabulary import EngineInfo

    info = EngineInfo("torch", "tiny", "cpu", 24000, mode="base")
    assert [v.name for v in describe(info, "kitchen", ("alice",)).tts[0].voices] == ["alice"]
    assert [v.name for v in describe(info, "kitchen").tts[0].voices] != ["alice"]


# -- a voice renamed or removed while a request speaks it -----------------------------------


async def test_a_voice_renamed_while_it_speaks_finishes_its_later_sentences(tmp_path: Path) -> None:
    """The web page renamed a voice while its sample played: the second sentence read the recording
    again from a folder that was gone, and the stream failed part-way."""
    from s2s_daemon.audio.playback import PlaybackStage
    from s2s_daemon.audio.sink import DiscardSink
    from s2s_daemon.pipeline.channel import Channel, Overflow
    from s2s_daemon.pipeline.jobs import Ledger, SpeakerTurn
    from s2s_daemon.pipeline.messages import SayRequest, Status
    from s2s_daemon.pipeline.queue import RequestQueue
    from s2s_daemon.pipeline.vocabulary import EngineInfo
    from s2s_daemon.tts.engine import EngineOptions
    from s2s_daemon.tts.stage import TtsStage
    from s2s_daemon.tts.worker import EngineWorker
    from tests.support.tone_engine import ToneEngine

    root = tmp_path / "voices"
    _voice(root, "dave")
    read: list[bytes] = []
    copies: list[str] = []

    class CloningTone(ToneEngine):
        """Reads the recording on every sentence, as the real engines do; renames the voice after the first."""

        def load_blocking(self) -> EngineInfo:
            return dataclasses.replace(super().load_blocking(), mode="base", voices=())

        def synthesize_blocking(self, request: Any, should_stop: Any) -> Any:
            assert request.ref_audio is not None and request.voice is None
            read.append(Path(request.ref_audio).read_bytes())
            copies.append(request.ref_audio)
            if len(read) == 1:
                (root / "dave").rename(root / "dave2")  # what the web page's rename does
            return super().synthesize_blocking(request, should_stop)

    worker = EngineWorker(CloningTone(EngineOptions(model="tone")))
    info = await worker.load()

    class Seen:
        def started(self, job: Any) -> None: ...
        def finished(self, job: Any) -> None: ...
        def state_changed(self) -> None: ...

    requests = RequestQueue(4)
    ledger = Ledger(requests, Seen(), 16)
    utterances: Channel[SpeakerTurn] = Channel(1, Overflow.BLOCK, "utterances")
    library = VoiceLibrary(root, info.mode)
    tts = TtsStage(worker, info, requests, utterances, ledger, chunk_frames=2, library=library)
    tasks = [
        asyncio.create_task(tts.run()),
        asyncio.create_task(PlaybackStage(DiscardSink(), utterances, ledger).run()),
    ]
    try:
        text = "The first sentence is here. And the second one follows it."
        job = ledger.submit(SayRequest(id="r", text=text, voice="dave", language="english", site_id="t"))
        await asyncio.wait_for(job.done.wait(), 20)
    finally:
        requests.close()
        await asyncio.wait_for(asyncio.gather(*tasks), 10)
        await worker.close()
    assert job.status is Status.COMPLETED, job.error
    assert len(read) == 2 and read[0] == read[1] == REF_WAV.read_bytes()
    assert not any(map(os.path.exists, copies)), "the private copies are removed"
