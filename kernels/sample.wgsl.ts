/**
 * GPU sampling: penalties → top-k → top-p → min-p → temperature → draw, so decode reads back one u32.
 *
 * Every filter keeps the logits at or above a threshold, so the candidate set is `key(logit) >= threshold` where
 * `key` maps f32 to u32 in the same order. The top-k and top-p thresholds come from an exact radix select over the
 * keys (4 rounds of 8 bits: a per-workgroup histogram pass, then a one-workgroup pass that picks the bin), so no
 * sort is needed on a 152K vocabulary. Ties at a threshold are all kept. Histograms use integer atomics only (the
 * top-p mass in exact 32.32 fixed point) and every float sum runs in a fixed order, so a (seed, step) pair always
 * draws the same token whatever the scheduling.
 *
 * Each pass is its own shader with bindings 0..n-1 in the order `prepareSampler` binds them.
 */

import { wgslConstants } from './wgsl-constants.ts';

/** Invocations of a workgroup in every pass. */
export const SAMPLE_WORKGROUP = 256;
/** Logits an invocation takes in the multi-workgroup passes. */
const SAMPLE_TILES = 16;
/** Logits per workgroup in the multi-workgroup passes (WG x TILES). */
export const SAMPLE_SPAN = SAMPLE_WORKGROUP * SAMPLE_TILES;

/** Declarations shared by every pass. */
const common =
  wgslConstants({ WG: SAMPLE_WORKGROUP, TILES: SAMPLE_TILES }) +
  /* wgsl */ `
const SPAN: u32 = WG * TILES;
const NONE: u32 = 0xffffffffu;
const NO_BIN: u32 = 256u;
const MODE_COUNT: u32 = 0u;
const MODE_MASS: u32 = 1u;
// The logit of a token the mask forbids: the lowest f32 (WGSL has no -Infinity constant). Its weight in every pass
// is 0 next to any allowed logit, and the penalty leaves it alone.
const FORBIDDEN: f32 = -3.4028234e38;

struct Params {
  vocab: u32,
  temperature: f32,
  topK: u32,
  topP: f32,
  minP: f32,
  penalty: f32,
  seedLo: u32,
  seedHi: u32,
  step: u32,
  historyCapacity: u32,
  // 1: the copy pass keeps only the ids whose bit is set in the token mask (a grammar's allowed next tokens).
  masked: u32,
  pad1: u32,
}

// Written by the one-workgroup passes, read by the others; rewritten from scratch every step.
struct State {
  maxLogit: f32,
  argmax: u32,
  done: u32,
  prefix: u32,
  needCount: u32,
  needMass: f32,
  kKey: u32,
  pKey: u32,
}

struct Stage { mode: u32, digit: u32, pad0: u32, pad1: u32 }

fn groupCount(vocab: u32) -> u32 { return (vocab + SPAN - 1u) / SPAN; }

// Scratch layout, in u32 words, for n workgroups: max[n] argmax[n] sum[n] counts[n][256] mass[n][lo 256, hi 256].
fn offMax(n: u32) -> u32 { return 0u; }
fn offArg(n: u32) -> u32 { return n; }
fn offSum(n: u32) -> u32 { return 2u * n; }
fn offCount(n: u32) -> u32 { return 3u * n; }
fn offMass(n: u32) -> u32 { return 3u * n + 256u * n; }

// Monotonic f32 -> u32 (a < b  <=>  key(a) < key(b)); -0 is folded onto +0 so equal values get equal keys.
fn orderedKey(v: f32) -> u32 {
  var bits = bitcast<u32>(v);
  if (bits == 0x80000000u) { bits = 0u; }
  if ((bits & 0x80000000u) != 0u) { return ~bits; }
  return bits | 0x80000000u;
}

fn selectActive(p: Params, mode: u32) -> bool {
  if (mode == MODE_COUNT) { return p.topK > 0u && p.topK < p.vocab; }
  return p.topP < 1.0;
}

// The lowest key that survives every filter: max of the top-k, top-p and min-p thresholds.
fn finalKey(p: Params, s: State) -> u32 {
  var k = max(s.kKey, s.pKey);
  if (p.minP > 0.0) { k = max(k, orderedKey(s.maxLogit + log(p.minP))); }
  return k;
}

// Unnormalized softmax(logit / T) weight of a candidate, 0 for a filtered token.
fn drawWeight(x: f32, threshold: u32, maxLogit: f32, temperature: f32) -> f32 {
  if (orderedKey(x) < threshold) { return 0.0; }
  return exp((x - maxLogit) / temperature);
}

// PCG hash (O'Neill; Jarzynski & Olano 2020): counter-based, so a draw depends only on (seed, step).
fn pcg(v: u32) -> u32 {
  let s = v * 747796405u + 2891336453u;
  let w = ((s >> ((s >> 28u) + 4u)) ^ s) * 277803737u;
  return (w >> 22u) ^ w;
}

fn uniformDraw(p: Params) -> f32 {
  let h = pcg(pcg(pcg(p.seedLo) ^ p.seedHi) + p.step);
  return f32(h >> 8u) * (1.0 / 16777216.0);
}

`;

/**
 * work[i] = logits[i], or FORBIDDEN where the token mask (bit i % 32 of word i / 32) forbids i while a mask is on;
 * the penalties then edit `work` in place.
 */
const copyWgsl =
  common +
  /* wgsl */ `
@group(0) @binding(0) var<storage, read> logits: array<f32>;
@group(0) @binding(1) var<storage, read_write> work: array<f32>;
@group(0) @binding(2) var<uniform> params: Params;
@group(0) @binding(3) var<storage, read> tokenMask: array<u32>;

@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
  let i = gid.x;
  if (i >= params.vocab) { return; }
  let allowed = params.masked == 0u || ((tokenMask[i / 32u] >> (i % 32u)) & 1u) == 1u;
  work[i] = select(FORBIDDEN, logits[i], allowed);
}
`;

/**
 * Repetition penalty, llama.cpp semantics: each token present in the history ring gets logit/penalty if its logit
 * is positive, logit*penalty otherwise, once however often it repeats (recomputed from `logits`, so duplicates
 * write the same value).
 */
const penaltyWgsl =
  common +
  /* wgsl */ `
@group(0) @binding(0) var<storage, read> logits: array<f32>;
@group(0) @binding(1) var<storage, read_write> work: array<f32>;
@group(0) @binding(2) var<storage, read> history: array<u32>;
@group(0) @binding(3) var<uniform> params: Params;

@compute @workgroup_size(WG)
fn main(@builtin(local_invocation_id) lid: vec3<u32>) {
  if (params.penalty == 1.0) { return; }
  let stored = min(history[0], params.historyCapacity);
  for (var j = lid.x; j < stored; j += WG) {
    let id = history[1u + j];
    // A token the mask forbids stays forbidden.
    if (id < params.vocab && work[id] > FORBIDDEN) {
      let l = logits[id];
      work[id] = select(l * params.penalty, l / params.penalty, l > 0.0);
    }
  }
}
`;

/** Per-workgroup max and argmax (lowest id among equal maxima). */
const partialMaxWgsl =
  common +
  /* wgsl */ `
@group(0) @binding(0) var<storage, read> work: array<f32>;
@group(0) @binding(1) var<storage, read_write> scratch: array<u32>;
@group(0) @binding(2) var<uniform> params: Params;

var<workgroup> bestValue: array<f32, WG>;
var<workgroup> bestIndex: array<u32, WG>;

fn better(v: f32, i: u32, than: f32, thanIndex: u32) -> bool {
  if (i == NONE) { return false; }
  if (thanIndex == NONE) { return true; }
  return v > than || (v == than && i < thanIndex);
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
  let base = wg.x * SPAN;
  let end = min(base + SPAN, params.vocab);
  var v = -3.0e38; // overwritten by the first element (idx == NONE)
  var idx = NONE;
  for (var i = base + lid.x; i < end; i += WG) {
    let x = work[i];
    if (better(x, i, v, idx)) { v = x; idx = i; }
  }
  bestValue[lid.x] = v;
  bestIndex[lid.x] = idx;
  workgroupBarrier();
  for (var stride = WG / 2u; stride > 0u; stride /= 2u) {
    if (lid.x < stride) {
      let ov = bestValue[lid.x + stride];
      let oi = bestIndex[lid.x + stride];
      if (better(ov, oi, bestValue[lid.x], bestIndex[lid.x])) {
        bestValue[lid.x] = ov;
        bestIndex[lid.x] = oi;
      }
    }
    workgroupBarrier();
  }
  if (lid.x == 0u) {
    let n = groupCount(params.vocab);
    scratch[offMax(n) + wg.x] = bitcast<u32>(bestValue[0]);
    scratch[offArg(n) + wg.x] = bestIndex[0];
  }
}
`;

/** Global max/argmax; resets the step's state; with temperature 0 writes the argmax and ends the step here. */
const reduceMaxWgsl =
  common +
  /* wgsl */ `
@group(0) @binding(0) var<storage, read> scratch: array<u32>;
@group(0) @binding(1) var<storage, read_write> state: State;
@group(0) @binding(2) var<storage, read_write> output: array<u32>;
@group(0) @binding(3) var<storage, read_write> history: array<u32>;
@group(0) @binding(4) var<uniform> params: Params;

@compute @workgroup_size(1)
fn main() {
  let n = groupCount(params.vocab);
  var v = bitcast<f32>(scratch[offMax(n)]);
  var idx = scratch[offArg(n)];
  for (var g = 1u; g < n; g++) {
    let gv = bitcast<f32>(scratch[offMax(n) + g]);
    // Groups are in id order, so a strict > keeps the lowest id among equal maxima.
    if (gv > v) { v = gv; idx = scratch[offArg(n) + g]; }
  }
  state.maxLogit = v;
  state.argmax = idx;
  state.prefix = 0u;
  state.needCount = 0u;
  state.needMass = 0.0;
  state.kKey = 0u;
  state.pKey = 0u;
  if (params.temperature == 0.0) {
    state.done = 1u;
    output[0] = idx;
    let count = history[0];
    history[1u + count % params.historyCapacity] = idx;
    history[0] = count + 1u;
  } else {
    state.done = 0u;
  }
}
`;

/**
 * One radix-select round: per-workgroup histogram of one 8-bit digit of the keys that match the prefix chosen so
 * far. Everything is integer workgroup atomics, so the result does not depend on thread order: counts, and in mass
 * mode the softmax weights exp(logit - max) in 32.32 fixed point (a lo/hi pair of u32, the carry taken from the
 * value atomicAdd returns). A weight is its f32 value truncated to a multiple of 2^-32 of the top weight.
 */
const histogramWgsl =
  common +
  /* wgsl */ `
@group(0) @binding(0) var<storage, read> work: array<f32>;
@group(0) @binding(1) var<storage, read_write> scratch: array<u32>;
@group(0) @binding(2) var<storage, read> state: State;
@group(0) @binding(3) var<uniform> params: Params;
@group(0) @binding(4) var<uniform> stage: Stage;

var<workgroup> counts: array<atomic<u32>, 256>;
var<workgroup> massLo: array<atomic<u32>, 256>;
var<workgroup> massHi: array<atomic<u32>, 256>;
var<workgroup> flag: u32;

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
  let mode = stage.mode;
  let digit = stage.digit;
  if (lid.x == 0u) { flag = select(0u, 1u, state.done == 0u && selectActive(params, mode)); }
  atomicStore(&counts[lid.x], 0u);
  atomicStore(&massLo[lid.x], 0u);
  atomicStore(&massHi[lid.x], 0u);
  if (workgroupUniformLoad(&flag) == 0u) { return; }
  let lower = select(0u, state.kKey, mode == MODE_MASS);
  let prefix = state.prefix;
  let maxLogit = state.maxLogit;
  let end = min((wg.x + 1u) * SPAN, params.vocab);
  for (var i = wg.x * SPAN + lid.x; i < end; i += WG) {
    let x = work[i];
    let key = orderedKey(x);
    if (key >= lower && (digit == 0u || (key >> (32u - 8u * digit)) == prefix)) {
      let bin = (key >> (24u - 8u * digit)) & 255u;
      atomicAdd(&counts[bin], 1u);
      if (mode == MODE_MASS) {
        // 4294967040 is the largest f32 below 2^32, so the conversion never saturates.
        let q = u32(min(exp(x - maxLogit) * 4294967296.0, 4294967040.0));
        if (atomicAdd(&massLo[bin], q) > 0xffffffffu - q) { atomicAdd(&massHi[bin], 1u); }
      }
    }
  }
  workgroupBarrier();
  let n = groupCount(params.vocab);
  scratch[offCount(n) + wg.x * 256u + lid.x] = atomicLoad(&counts[lid.x]);
  if (mode == MODE_MASS) {
    scratch[offMass(n) + wg.x * 512u + lid.x] = atomicLoad(&massLo[lid.x]);
    scratch[offMass(n) + wg.x * 512u + 256u + lid.x] = atomicLoad(&massHi[lid.x]);
  }
}
`;

/**
 * Picks the bin holding the threshold: scanning digits from high to low, the first non-empty bin where the count
 * (top-k: k) or softmax mass (top-p: p times the mass of the top-k survivors) accumulated from the top reaches the
 * target. After round 3 the prefix is the full key of the threshold logit.
 */
const selectWgsl =
  common +
  /* wgsl */ `
@group(0) @binding(0) var<storage, read> scratch: array<u32>;
@group(0) @binding(1) var<storage, read_write> state: State;
@group(0) @binding(2) var<uniform> params: Params;
@group(0) @binding(3) var<uniform> stage: Stage;

var<workgroup> binCount: array<u32, 256>;
var<workgroup> binMass: array<f32, 256>;
var<workgroup> flag: u32;

@compute @workgroup_size(WG)
fn main(@builtin(local_invocation_id) lid: vec3<u32>) {
  let mode = stage.mode;
  let digit = stage.digit;
  if (lid.x == 0u) { flag = select(0u, 1u, state.done == 0u && selectActive(params, mode)); }
  if (workgroupUniformLoad(&flag) == 0u) { return; }
  let n = groupCount(params.vocab);
  var c = 0u;
  var lo = 0u;
  var hi = 0u;
  for (var g = 0u; g < n; g++) {
    c += scratch[offCount(n) + g * 256u + lid.x];
    if (mode == MODE_MASS) {
      let add = scratch[offMass(n) + g * 512u + lid.x];
      if (lo > 0xffffffffu - add) { hi += 1u; }
      lo += add;
      hi += scratch[offMass(n) + g * 512u + 256u + lid.x];
    }
  }
  binCount[lid.x] = c;
  // The exact 32.32 sum, rounded once to f32 (units of the top weight).
  binMass[lid.x] = f32(hi) + f32(lo) * (1.0 / 4294967296.0);
  workgroupBarrier();
  if (lid.x != 0u) { return; }

  var needCount = state.needCount;
  var needMass = state.needMass;
  if (digit == 0u) {
    needCount = params.topK;
    if (mode == MODE_MASS) {
      var z = 0.0;
      for (var b = 0u; b < 256u; b++) { z += binMass[b]; }
      needMass = params.topP * z;
    }
  }
  var chosen = NO_BIN;
  var last = NO_BIN;
  var cumCount = 0u;
  var cumMass = 0.0;
  for (var k = 0u; k < 256u; k++) {
    let b = 255u - k;
    if (binCount[b] == 0u) { continue; }
    last = b;
    if (mode == MODE_COUNT) {
      if (cumCount + binCount[b] >= needCount) { chosen = b; needCount -= cumCount; break; }
      cumCount += binCount[b];
    } else {
      if (cumMass + binMass[b] >= needMass) { chosen = b; needMass -= cumMass; break; }
      cumMass += binMass[b];
    }
  }
  if (chosen == NO_BIN) {
    // Rounding left the target just above the total: keep the whole lowest bin.
    chosen = last;
    needCount = binCount[last];
    needMass = binMass[last];
  }
  let prefix = select((state.prefix << 8u) | chosen, chosen, digit == 0u);
  state.prefix = prefix;
  state.needCount = needCount;
  state.needMass = needMass;
  if (digit == 3u) {
    if (mode == MODE_COUNT) { state.kKey = prefix; } else { state.pKey = prefix; }
  }
}
`;

/** Per-workgroup sum of the draw weights; thread t sums the contiguous chunk the draw pass scans. */
const partialSumWgsl =
  common +
  /* wgsl */ `
@group(0) @binding(0) var<storage, read> work: array<f32>;
@group(0) @binding(1) var<storage, read_write> scratch: array<u32>;
@group(0) @binding(2) var<storage, read> state: State;
@group(0) @binding(3) var<uniform> params: Params;

var<workgroup> partial: array<f32, WG>;
var<workgroup> flag: u32;

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
  if (lid.x == 0u) { flag = state.done; }
  if (workgroupUniformLoad(&flag) != 0u) { return; }
  let threshold = finalKey(params, state);
  let maxLogit = state.maxLogit;
  let start = wg.x * SPAN + lid.x * TILES;
  let end = min(start + TILES, params.vocab);
  var s = 0.0;
  for (var i = start; i < end; i++) { s += drawWeight(work[i], threshold, maxLogit, params.temperature); }
  partial[lid.x] = s;
  workgroupBarrier();
  for (var stride = WG / 2u; stride > 0u; stride /= 2u) {
    if (lid.x < stride) { partial[lid.x] += partial[lid.x + stride]; }
    workgroupBarrier();
  }
  if (lid.x == 0u) { scratch[offSum(groupCount(params.vocab)) + wg.x] = bitcast<u32>(partial[0]); }
}
`;

/**
 * Inverse-CDF draw in id order with one uniform number u = hash(seed, step): the first candidate whose cumulative
 * weight exceeds u * total, found group → chunk → token. Writes the id and appends it to the history ring.
 */
const drawWgsl =
  common +
  /* wgsl */ `
@group(0) @binding(0) var<storage, read> work: array<f32>;
@group(0) @binding(1) var<storage, read> scratch: array<u32>;
@group(0) @binding(2) var<storage, read> state: State;
@group(0) @binding(3) var<storage, read_write> output: array<u32>;
@group(0) @binding(4) var<storage, read_write> history: array<u32>;
@group(0) @binding(5) var<uniform> params: Params;

var<workgroup> chunkSum: array<f32, WG>;
var<workgroup> flag: u32;
var<workgroup> pickedGroup: u32;
var<workgroup> remainder: f32;

const HUGE: f32 = 3.0e38;

@compute @workgroup_size(WG)
fn main(@builtin(local_invocation_id) lid: vec3<u32>) {
  if (lid.x == 0u) { flag = state.done; }
  if (workgroupUniformLoad(&flag) != 0u) { return; }
  let n = groupCount(params.vocab);
  if (lid.x == 0u) {
    var total = 0.0;
    for (var g = 0u; g < n; g++) { total += bitcast<f32>(scratch[offSum(n) + g]); }
    let goal = uniformDraw(params) * total;
    var cum = 0.0;
    var sel = NONE;
    var last = 0u;
    for (var g = 0u; g < n; g++) {
      let s = bitcast<f32>(scratch[offSum(n) + g]);
      if (s > 0.0) {
        last = g;
        if (cum + s > goal) { sel = g; break; }
        cum += s;
      }
    }
    if (sel == NONE) {
      pickedGroup = last;
      remainder = HUGE;
    } else {
      pickedGroup = sel;
      remainder = goal - cum;
    }
  }
  let g = workgroupUniformLoad(&pickedGroup);
  let threshold = finalKey(params, state);
  let maxLogit = state.maxLogit;
  let start = g * SPAN + lid.x * TILES;
  let end = min(start + TILES, params.vocab);
  var s = 0.0;
  for (var i = start; i < end; i++) { s += drawWeight(work[i], threshold, maxLogit, params.temperature); }
  chunkSum[lid.x] = s;
  workgroupBarrier();
  if (lid.x != 0u) { return; }

  var rem = remainder;
  var cum = 0.0;
  var chunk = NONE;
  var lastChunk = 0u;
  for (var t = 0u; t < WG; t++) {
    let cs = chunkSum[t];
    if (cs > 0.0) {
      lastChunk = t;
      if (cum + cs > rem) { chunk = t; break; }
      cum += cs;
    }
  }
  if (chunk == NONE) {
    chunk = lastChunk;
    rem = HUGE;
    cum = 0.0;
  }
  let first = g * SPAN + chunk * TILES;
  let stop = min(first + TILES, params.vocab);
  var chosen = NONE;
  var lastPositive = state.argmax;
  for (var i = first; i < stop; i++) {
    let w = drawWeight(work[i], threshold, maxLogit, params.temperature);
    if (w > 0.0) {
      lastPositive = i;
      if (cum + w > rem) { chosen = i; break; }
      cum += w;
    }
  }
  if (chosen == NONE) { chosen = lastPositive; }
  output[0] = chosen;
  let count = history[0];
  history[1u + count % params.historyCapacity] = chosen;
  history[0] = count + 1u;
}
`;

export const sampleWgsl = {
  copy: copyWgsl,
  penalty: penaltyWgsl,
  partialMax: partialMaxWgsl,
  reduceMax: reduceMaxWgsl,
  histogram: histogramWgsl,
  select: selectWgsl,
  partialSum: partialSumWgsl,
  draw: drawWgsl,
} as const;
