"""``Workload``: each bad field is refused in one line naming its option, and the engines,
``estimate`` and ``step_time`` answer the same for a workload as for the loose keywords."""

from dataclasses import replace

import pytest

import batchfit
from batchfit.errors import UsageError, python_spelling
from batchfit.hardware import get_gpu
from batchfit.lengths import LengthsSummary
from batchfit.memory.estimate import estimate
from batchfit.models import resolve_model
from batchfit.spec import TrainingSetup
from batchfit.speed import step_time
from batchfit.workload import Workload

GPT2 = resolve_model("gpt2")
T4 = get_gpu("t4")
LENGTHS = LengthsSummary(480, "longest", 480, 300.0, 3, ("lengths.txt",))


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"micro_batch_size": 0}, "--micro-batch must be a positive integer, got 0"),
        ({"micro_batch_size": -3}, "--micro-batch must be a positive integer, got -3"),
        ({"micro_batch_size": True}, "--micro-batch must be a positive integer, got True"),
        ({"micro_batch_size": 2.0}, "--micro-batch must be a positive integer, got 2.0"),
        ({"seq_len": -1}, "--seq-len must be a positive integer, got -1"),
        ({"seq_len": "512"}, "--seq-len must be a positive integer, got '512'"),
        ({"device": "tpu"}, "--device 'tpu' is not one of: cpu, cuda"),
        ({"device": "cpu", "gpu": T4}, "--gpu and --device cpu contradict each other: drop one"),
        ({"gpu": "t4"}, "--gpu must be a GpuSpec (batchfit.get_gpu(NAME)), got 't4'"),
        ({"grad_accum_steps": 0}, "--grad-accum must be a positive integer, got 0"),
        ({"grad_accum_steps": False}, "--grad-accum must be a positive integer, got False"),
        ({"lengths": {"seq_len": 512}}, "--lengths must be a LengthsSummary"),
        ({"lengths": LENGTHS}, "--seq-len 512 and --lengths (planned at 480 tokens) disagree"),
    ],
)
def test_each_bad_field_is_refused_in_one_line_naming_its_option(fields, message):
    with pytest.raises(UsageError) as caught:
        Workload(**{"micro_batch_size": 8, "seq_len": 512, **fields})
    # the command line's option names; str() in Python names the argument
    assert caught.value.args[0].startswith(message)
    text = str(caught.value)
    assert text.startswith(python_spelling(message))
    assert "--" not in text
    assert "\n" not in text


def test_a_good_workload_keeps_its_fields_and_defaults():
    w = Workload(micro_batch_size=8, seq_len=480, gpu=T4, lengths=LENGTHS)
    assert (w.micro_batch_size, w.seq_len, w.device, w.gpu, w.grad_accum_steps) == (
        8,
        480,
        "cuda",
        T4,
        1,
    )
    assert w.lengths is LENGTHS
    assert Workload(micro_batch_size=1, seq_len=1, device="cpu").gpu is None


def test_a_workload_is_frozen_and_replace_checks_again():
    w = Workload(micro_batch_size=8, seq_len=512)
    with pytest.raises(AttributeError):
        w.micro_batch_size = 4  # type: ignore[misc]
    assert replace(w, micro_batch_size=4).micro_batch_size == 4
    with pytest.raises(UsageError, match="micro_batch_size must be a positive integer"):
        replace(w, micro_batch_size=0)


def test_workload_is_public():
    assert batchfit.Workload is Workload
    assert "Workload" in batchfit.__all__


@pytest.mark.parametrize("engine", ["analytic", "trace"])
@pytest.mark.parametrize(
    "sizes",
    [
        {"micro_batch_size": 2, "seq_len": 64, "device": "cpu"},
        {"micro_batch_size": 4, "seq_len": 128, "gpu": T4, "grad_accum_steps": 3},
    ],
    ids=["cpu", "t4-accum"],
)
def test_estimate_of_a_workload_equals_the_keyword_form(engine, sizes):
    setup = TrainingSetup()
    loose = estimate(GPT2, setup, engine=engine, **sizes)
    whole = estimate(GPT2, setup, engine=engine, workload=Workload(**sizes))
    assert whole == loose
    assert (whole.micro_batch_size, whole.seq_len) == (sizes["micro_batch_size"], sizes["seq_len"])
    if "gpu" in sizes:  # the step time reads the GPU and the accumulation from the workload
        assert whole.extras["grad_accum_steps"] == 3
        assert whole.device == "cuda:t4"


def test_estimate_refuses_a_workload_beside_its_keywords():
    w = Workload(micro_batch_size=2, seq_len=64, device="cpu")
    for extra in ({"micro_batch_size": 2}, {"seq_len": 64}, {"gpu": T4}, {"device": "cpu"}):
        with pytest.raises(UsageError, match="workload= holds micro_batch_size, seq_len"):
            estimate(GPT2, TrainingSetup(), engine="analytic", workload=w, **extra)
    with pytest.raises(UsageError, match=r"workload= takes a batchfit\.Workload, got tuple"):
        estimate(GPT2, TrainingSetup(), engine="analytic", workload=(2, 64))  # type: ignore[arg-type]


def test_an_own_module_takes_no_workload():
    # its sizes come from its batch_fn: refused before anything is built
    with pytest.raises(UsageError, match="reads your module's sizes from batch_fn"):
        estimate(lambda: None, batch_fn=lambda: None, workload=Workload(2, 64, "cpu"))


def test_estimate_keyword_form_checks_what_a_workload_checks():
    with pytest.raises(UsageError, match="grad_accum_steps must be a positive integer, got 0"):
        estimate(GPT2, micro_batch_size=2, seq_len=64, gpu=T4, grad_accum_steps=0)
    with pytest.raises(UsageError, match="gpu and device cpu contradict each other"):
        estimate(GPT2, micro_batch_size=2, seq_len=64, device="cpu", gpu=T4, engine="analytic")


def test_an_image_model_keeps_its_image_size_message():
    # the model's check runs before the workload's: an image side is --image-size
    vit = resolve_model("vit-base-patch16-224")
    with pytest.raises(UsageError, match="image_size must be a positive number of pixels"):
        estimate(vit, micro_batch_size=2, seq_len=0, device="cpu")


def test_step_time_of_a_workload_equals_the_keyword_form():
    setup = TrainingSetup(precision="amp-fp16")
    loose = step_time(GPT2, setup, T4, micro_batch_size=4, seq_len=256)
    whole = step_time(GPT2, setup, T4, workload=Workload(micro_batch_size=4, seq_len=256, gpu=T4))
    assert loose is not None
    assert whole == loose
    with pytest.raises(UsageError, match="step_time needs micro_batch_size= and seq_len="):
        step_time(GPT2, setup, T4)
    with pytest.raises(UsageError, match="step_time needs micro_batch_size= and seq_len="):
        step_time(GPT2, setup, T4, micro_batch_size=4, workload=Workload(4, 256))
