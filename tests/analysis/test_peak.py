"""What is live at the memory peak (``explain(..., peak=True)``, ``analysis.peak``): XLA's
heap simulation, parsed from its dump and checked against a program whose peak is known."""

import jax
import jax.numpy as jnp
from rich.console import Console

from shardlib.analysis import explain
from shardlib.analysis import peak as peak_dump

# the shape of XLA's dump (jaxlib 0.10): tree marks, then "label (pct%, total: n bytes, ...)"
TREE = (
    ("    ", "main.1", "3 000"),
    ("      ├── ", "jit(f)/jvp()/while", "1 800"),
    ("      │   └── ", "region_0.clone", "1 800"),
    ("      │       ├── ", "jit(f)/jvp()/while/body/dynamic_update_slice", "1 500"),
    ("      │       └── ", "jit(f)/jvp()/while/body/mul", "300"),
    ("      ├── ", "state", "600"),
    ("      │   └── ", "params", "600"),
    ("      ├── ", "state['opt_state'][1][0].mu['w']", "150"),
    ("      ├── ", "state['opt_state'][1][0].nu['w']", "150"),
    ("      ├── ", "copy.12", "150"),
    ("      └── ", "jit(f)/transpose(jvp())/mul", "150"),
)
DUMP = "HloLiveRange (max 9):\n  Stack trace breakdown for peak usage: 3 000 bytes\n" + "".join(
    f"{marks}{label} (5.0%, total: {total} bytes, current: 0 bytes, remaining: 0 bytes)\n"
    for marks, label, total in TREE
)


def test_the_dump_is_read_part_by_part():
    peak = peak_dump.parse(DUMP)
    assert peak.live_bytes == 3000
    assert dict(peak.parts) == {
        "jit(f)/jvp()/while": 1800,
        "state": 600,
        "state['opt_state']": 300,  # the optimizer state's leaves, as one line
        peak_dump.UNNAMED: 150,
        "jit(f)/transpose(jvp())/mul": 150,
    }
    assert (peak.where, peak.phase) == ("jit(f)/jvp()/while", "forward")
    assert peak.inside[0] == ("jit(f)/jvp()/while/body/dynamic_update_slice", 1500)
    assert peak_dump.parse("no breakdown here") is None


def test_a_layer_loop_peaks_holding_its_stacked_activations():
    """A 16-layer scan saving a [16, 256, 256] fp32 stack (4 MiB) for its backward: at the
    peak XLA holds at least that stack, in the loop (jax 0.12 counts values sharing a buffer
    in place apart, so the count may exceed the allocation)."""
    layers, rows, width = 16, 256, 256

    def loss(w, x):  # w: [layers, width, width], x: [rows, width]
        def layer(h, w_l):
            return jnp.tanh(h @ w_l), None

        return jnp.sum(jax.lax.scan(layer, x, w)[0] ** 2)

    args = (
        jax.ShapeDtypeStruct((layers, width, width), jnp.float32),
        jax.ShapeDtypeStruct((rows, width), jnp.float32),
    )
    report = explain(jax.jit(jax.grad(loss)), *args, peak=True)
    peak = report.peak
    stack = layers * rows * width * 4
    assert stack <= peak.live_bytes and peak.allocated_bytes == report.memory.total_bytes
    assert peak.packing_bytes == max(0, peak.allocated_bytes - peak.live_bytes)
    assert "while" in peak.where and peak.phase in ("forward", "backward")
    assert report.to_json()["memory_peak"]["live_bytes"] == peak.live_bytes
    assert explain(jax.jit(jax.grad(loss)), *args).peak is None  # only when asked


def test_the_table_names_the_loop_and_what_it_keeps():
    console = Console(width=100, record=True)
    console.print(peak_dump.parse(DUMP).table())
    text = console.export_text()
    assert "forward: jit(f)/jvp()/while" in text
    assert "of which .../body/dynamic_update_slice" in text
