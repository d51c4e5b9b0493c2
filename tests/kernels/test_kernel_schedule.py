"""Instruction order that the compiled core depends on for speed, read from its sm_90 SASS (cuobjdump).

Kernels launched with PDL issue loads of what no kernel of the chain writes (weights, step metadata, the
RoPE table) before griddepcontrol.wait, so that they are in flight while the previous kernel finishes
(launch.h). ptxas is free to schedule the wait above those loads, which then start only after the previous
kernel has completed: the results stay right and the decode step is slower. These tests need no GPU, only the built core and cuobjdump with nvdisasm (CUDA's bin folder, or the
nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm wheels)."""
import glob
import os
import re
import shutil
import subprocess
import sysconfig

import pytest

import nanograph

WEIGHT_BATCH = 8  # 16-byte weight loads per lane issued together: gemv.cu's 8 steps, gemv_fp8.cu's 4 steps x 2 rows


def _tool_dirs():
    dirs = [os.path.dirname(p) for p in (shutil.which("cuobjdump"), shutil.which("nvdisasm")) if p]
    dirs.append("/usr/local/cuda/bin")
    for base in {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}:
        dirs += glob.glob(os.path.join(base, "nvidia", "cu*", "bin")) + glob.glob(
            os.path.join(base, "nvidia", "cuda_*", "bin"))
    return dirs


def _find(tool):
    for d in _tool_dirs():
        path = os.path.join(d, tool)
        if os.access(path, os.X_OK):
            return path
    return None


def _core_path():
    if not nanograph.core_available():
        return None
    from nanograph import _C
    return _C.__file__


def functions(sass: str) -> dict[str, list[str]]:
    """cuobjdump -sass text -> {mangled function name: its instructions, in order}."""
    out, current = {}, None
    for line in sass.splitlines():
        m = re.search(r"Function : (\S+)", line)
        if m:
            current = out.setdefault(m.group(1), [])
            continue
        m = re.search(r"/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;", line)  # 5 digits from 0x10000 on
        if m and current is not None:
            current.append(m.group(1))
    return out


@pytest.fixture(scope="module")
def sm90_functions():
    core = _core_path()
    if core is None:
        pytest.skip(f"the C++/CUDA core is not built ({nanograph.CORE_ERROR})")
    cuobjdump, nvdisasm = _find("cuobjdump"), _find("nvdisasm")
    if cuobjdump is None or nvdisasm is None:
        pytest.skip("cuobjdump and nvdisasm not found (CUDA's bin folder, or pip install "
                    "nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)")
    env = dict(os.environ, PATH=os.path.dirname(nvdisasm) + os.pathsep + os.environ.get("PATH", ""))
    # Only sm_90's code (sm_90a's too) is disassembled: the other architectures' would triple the time.
    result = subprocess.run([cuobjdump, "-sass", "-arch", "sm_90", core], capture_output=True, text=True, env=env,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    # cuobjdump prints one section per fatbin entry (cubin or PTX); none: the core has no sm_90 code.
    sections = re.split(r"\n(?=\s*arch = )", result.stdout)
    sm90 = "\n".join(s for s in sections if re.search(r"arch = sm_90", s))
    if not sm90:
        pytest.skip("the core was built without sm_90 code (NANOGRAPH_CUDA_ARCHS)")
    return functions(sm90)


def test_functions_parser():
    text = """
        Function : _Z3fooPi
        /*0000*/                   LDC R1, c[0x0][0x28] ;                 /* 0x00000a00ff017b82 */
        /*0010*/                   ACQBULK ;                               /* 0x0000000000007b1d */
        Function : _Z3barv
        /*0000*/                   EXIT ;                                  /* 0x000000000000794d */
        /*fff0*/                   NOP ;                                   /* 0x0000000000007918 */
        /*10000*/                  STL [R1], R2 ;                          /* 0x0000000201007387 */
    """
    assert functions(text) == {"_Z3fooPi": ["LDC R1, c[0x0][0x28]", "ACQBULK"],
                               "_Z3barv": ["EXIT", "NOP", "STL [R1], R2"]}


def _opcode(instruction):
    """The opcode of an instruction, without its predicate (`@!P2 LDG.E ...` -> `LDG.E`)."""
    return re.sub(r"^@!?U?P\w+\s+", "", instruction).split()[0]


def _waits(ins):
    return [i for i, x in enumerate(ins) if x.split()[0] == "ACQBULK" or " ACQBULK" in x]


def test_the_decode_streaming_kernels_never_spill(sm90_functions):
    """Decode attention's split_kernel variants and the GEMVs keep their in-flight loads and fragments in registers: a
    spill (STL/LDL, local memory) puts loads on the path of every step. Large e4m3 grids' next-step prefetch and the
    FP8 GEMV's 3-CTAs-per-SM variant sit at the edge of their register budgets."""
    kernels = {name: ins for name, ins in sm90_functions.items()
               if "split_kernel" in name or "gemv_kernel" in name or "gemv_fp8_kernel" in name}
    assert sum("split_kernel" in name for name in kernels) >= 16 and len(kernels) >= 32, \
        f"expected decode attention's and the GEMVs' variants, found {sorted(kernels)}"
    spilling = {name: sum(_opcode(x).startswith(("STL", "LDL")) for x in ins) for name, ins in kernels.items()}
    assert not any(spilling.values()), {name: n for name, n in spilling.items() if n}


def test_gemv_weight_loads_come_before_the_pdl_wait(sm90_functions):
    gemvs = {name: ins for name, ins in sm90_functions.items() if "gemv_kernel" in name or "gemv_fp8_kernel" in name}
    assert sum("gemv_fp8_kernel" in name for name in gemvs) >= 4, f"expected the FP8 GEMV's variants, found {sorted(gemvs)}"
    assert len(gemvs) >= 8, f"expected the GEMV's template variants, found {sorted(sm90_functions)[:20]}"
    for name, ins in gemvs.items():
        waits = _waits(ins)
        assert waits, f"{name}: no griddepcontrol.wait (ACQBULK)"
        # Weight loads bypass L1 (ld.global.nc.L1::no_allocate): LDG.E.NA.128.CONSTANT.
        weight_loads = [i for i, x in enumerate(ins) if re.search(r"\bLDG\S*\.NA\.128", x)]
        early = sum(1 for i in weight_loads if i < waits[0])
        assert early >= WEIGHT_BATCH, (
            f"{name}: {early} weight loads before the PDL wait (instruction {waits[0]}), expected the first "
            f"batch of {WEIGHT_BATCH}")


def test_fp8_gemv_block_scales_of_the_first_batch_come_before_the_pdl_wait(sm90_functions):
    """The FP8 GEMV at 16 resident warps and up to 8 rows of x (gemv_fp8_kernel<false, 8 or 16, *, 16>) loads the
    block scales of its first load batch (two rows x 4 steps, 32-bit loads) with the weights, before the wait:
    they come from DRAM, and after the wait they would hold up the batch's first MMAs."""
    early_scales = {name: ins for name, ins in sm90_functions.items()
                    if re.search(r"gemv_fp8_kernelILb0ELi(8|16)ELb[01]ELi16ELb[01]E", name)}
    assert len(early_scales) == 8, f"expected 8 variants, found {sorted(early_scales)}"
    for name, ins in early_scales.items():
        wait = _waits(ins)[0]
        scale_loads = [i for i, x in enumerate(ins) if _opcode(x).startswith("LDG") and ".128" not in x]
        early = sum(1 for i in scale_loads if i < wait)
        assert early >= 8, f"{name}: {early} 32-bit loads before the PDL wait (instruction {wait}), expected 8 scales"


def test_fp8_gemv_of_one_batch_splits_widens_its_weights_before_the_pdl_wait(sm90_functions):
    """Where every split of an FP8 GEMV is one load batch (gemv_fp8_kernel<false, 8 or 16, *, 16, true>: Qwen3-0.6B's
    projections), the whole split is in registers before the wait; all its e4m3 -> bf16 widening (64 e4m3 -> fp16
    conversions, and their bf16 packs but a few) come before the wait too, which leaves the wait only x's loads and
    the MMAs."""
    widen_early = {name: ins for name, ins in sm90_functions.items()
                   if re.search(r"gemv_fp8_kernelILb0ELi(8|16)ELb[01]ELi16ELb1E", name)}
    assert len(widen_early) == 4, f"expected 4 variants, found {sorted(widen_early)}"
    for name, ins in widen_early.items():
        wait = _waits(ins)[0]
        unpacks = [i for i, x in enumerate(ins) if "E4M3" in _opcode(x)]
        packs = [i for i, x in enumerate(ins) if _opcode(x).startswith("F2FP.BF16")]
        assert len(unpacks) == 64 and max(unpacks) < wait, (
            f"{name}: e4m3 conversions at {unpacks}, the wait at {wait}; expected all 64 before it")
        # ptxas may leave a pack or two just past the wait.
        assert sum(i < wait for i in packs) >= 60, f"{name}: fewer than 60 of 64 bf16 packs before the wait {wait}"


@pytest.mark.parametrize("kernel, what", [("rmsnorm_kernel", "the norm weight"),
                                          ("qk_norm_rope_kv_store_kernel", "position, slot, cos/sin, norm weight")])
def test_small_kernels_load_before_the_pdl_wait(sm90_functions, kernel, what):
    found = {name: ins for name, ins in sm90_functions.items() if kernel in name}
    assert found, f"no {kernel} in the core"
    for name, ins in found.items():
        waits = _waits(ins)
        assert waits, f"{name}: no griddepcontrol.wait (ACQBULK)"
        early = sum(1 for i, x in enumerate(ins[:waits[0]]) if re.search(r"\bLDG", x))
        assert early >= 1, f"{name}: {what} should be loaded before the PDL wait (instruction {waits[0]})"


@pytest.mark.parametrize("kernel", [r"embedding_kernel", r"rmsnorm_kernelILi\dELb0ELb1E"])
def test_step_entry_kernels_allow_dependents_only_after_their_wait(sm90_functions, kernel):
    """The kernel after a decode graph's metadata staging lets the next one launch (PREEXIT,
    griddepcontrol.launch_dependents) only after its own wait (ACQBULK): later kernels read the step's
    metadata before their waits (launch.h). The embedding with the first norm is that kernel in the
    model; the plain embedding keeps the same order for eager use."""
    found = {name: ins for name, ins in sm90_functions.items() if re.search(kernel, name)}
    assert found, f"no {kernel} in the core"
    for name, ins in found.items():
        waits = _waits(ins)
        triggers = [i for i, x in enumerate(ins) if x.split()[0] == "PREEXIT" or " PREEXIT" in x]
        assert waits and triggers, f"{name}: expected a wait and a trigger"
        assert waits[0] < triggers[0], f"{name}: PREEXIT at {triggers[0]} before the wait at {waits[0]}"


def test_norms_before_a_gemv_allow_dependents_before_their_wait(sm90_functions):
    """The in-layer norms let the next GEMV launch (and load its weights) while they wait."""
    found = {name: ins for name, ins in sm90_functions.items()
             if re.search(r"rmsnorm_kernelILi\dELb1ELb0E", name)}
    assert found, "no add_rmsnorm kernel in the core"
    for name, ins in found.items():
        triggers = [i for i, x in enumerate(ins) if x.split()[0] == "PREEXIT" or " PREEXIT" in x]
        assert triggers and triggers[0] < _waits(ins)[0], f"{name}: PREEXIT should come before the wait"


def test_small_grid_decode_attention_loads_its_first_keys_before_the_pdl_wait(sm90_functions):
    """Decode attention on small grids (split_kernel<HD, kEarlyKv = true, ...>, bf16 and FP8 caches) has each lane's
    first step of K and V fragments in flight before the wait that precedes its keys: 16 streaming loads
    (ld.global.cs: LDG.E.EF) at head_dim 64 and 128. (A CTA without keys waits on an earlier branch.)"""
    found = {name: ins for name, ins in sm90_functions.items()
             if re.search(r"split_kernelILi\d+ELb1E", name)}
    assert len(found) >= 16, f"expected the early-KV variants of decode attention, found {len(found)}"
    for name, ins in found.items():
        kv_loads = [i for i, x in enumerate(ins) if re.search(r"\bLDG\S*\.EF\.(64|128)", x)]
        waits = _waits(ins)
        assert waits, f"{name}: no griddepcontrol.wait (ACQBULK)"
        early = max(sum(1 for i in kv_loads if i < w) for w in waits)
        assert early >= 16, f"{name}: {early} K/V loads before its PDL wait, expected a step's 16"


def test_large_grid_decode_attention_prefetches_the_next_step_only_for_an_e4m3_cache(sm90_functions):
    """Decode attention on large grids (split_kernel<HD, kEarlyKv = false, kRope, ...>) requests each warp's next step
    of K and V into L2 (prefetch.global.L2: CCTL.E.PF2) with an e4m3 cache and the fused RoPE (the engine's large
    grids), whose tile is half a bf16 tile's bytes in flight; with a bf16 cache it does not (its 12 warps per SM keep
    enough bytes in flight), nor without the RoPE (the addresses would spill)."""
    found = {}
    for name, ins in sm90_functions.items():
        match = re.search(r"split_kernelILi\d+ELb0ELb([01])ELb0ELb([01])E", name)
        if match:
            found[name] = (match.group(1) == "1" and match.group(2) == "1", sum("CCTL.E.PF2" in x for x in ins))
    assert sum(wanted for wanted, _ in found.values()) >= 2 and len(found) >= 8, \
        f"expected the large-grid variants of decode attention (bf16 and e4m3, with and without RoPE), found {sorted(found)}"
    for name, (wanted, prefetches) in found.items():
        assert (prefetches > 0) == wanted, f"{name}: {prefetches} L2 prefetches"


def test_small_grid_decode_attention_reloads_the_newest_keys_step_before_reading_q(sm90_functions):
    """After its wait, decode attention on small grids without the fused RoPE (split_kernel<HD, true, false, ...>)
    requests the step holding the newest key again (streaming loads, LDG.E.EF) before it loads q (LDG.E.128): q's
    loads feed selects that wait for them, so in the other order the two round trips to L2 run one after the other."""
    found = {name: ins for name, ins in sm90_functions.items() if re.search(r"split_kernelILi\d+ELb1ELb0E", name)}
    assert len(found) >= 8, f"expected the small-grid variants without the fused RoPE, found {len(found)}"
    for name, ins in found.items():
        wait = _waits(ins)[-1]
        kv = [i for i, x in enumerate(ins) if re.search(r"\bLDG\S*\.EF\.(64|128)", x)]
        q = [i for i, x in enumerate(ins) if i > wait and re.search(r"\bLDG\.E\.128\b", x)]
        early = sum(i < wait for i in kv)  # the first step, loaded before the wait
        assert early >= 16 and q, f"{name}: expected a step of K/V loads before the wait and q loads after it"
        # The whole step is requested again ahead of q, not just its first loads.
        reloaded = sum(wait < i < q[0] for i in kv)
        assert reloaded == early, (
            f"{name}: {reloaded} of the step's {early} K/V loads come between the wait ({wait}) and q ({q[0]})")


def test_decode_attention_counts_its_parts_without_a_sequentially_consistent_fence(sm90_functions):
    """Every split_kernel variant that merges through the workspace counts its CTA's part with one acquire-release
    atomic (atom.acq_rel.gpu.add: MEMBAR.ALL.GPU, ATOMG, then CCTL.IVALL, L1 invalidated for the acquire), by one
    thread after the CTA's barrier. A __threadfence() (fence.sc.gpu: MEMBAR.SC.GPU) on that path, in every thread
    before the count or in the merging CTA after it, lengthens the chain that the step waits for."""
    found = {name: ins for name, ins in sm90_functions.items() if "split_kernel" in name}
    assert len(found) >= 16, f"expected decode attention's variants, found {sorted(found)}"
    for name, ins in found.items():
        atomics = [i for i, x in enumerate(ins) if _opcode(x).startswith("ATOMG")]
        assert atomics, f"{name}: no arrival count (ATOMG)"
        assert not any("MEMBAR.SC" in x for x in ins), f"{name}: a sequentially consistent fence (MEMBAR.SC)"
        for a in atomics:
            assert any("MEMBAR.ALL.GPU" in x for x in ins[max(a - 8, 0):a]), \
                f"{name}: the count at {a} has no release fence before it"
            assert any("CCTL.IVALL" in x for x in ins[a + 1:a + 9]), f"{name}: the count at {a} does not acquire"
