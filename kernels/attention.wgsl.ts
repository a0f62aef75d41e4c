import { kvPagesWgsl } from './kv-append.wgsl.ts';

/**
 * Causal GQA attention over the paged f16 KV cache, flash-decoding style. Workgroup (split s, head h, query t):
 * query t sits at position p = step.position + t and sees keys 0..p. The keys 0..step.length-1 are cut into
 * `splits` equal chunks; split s runs an online softmax (f32) over its chunk ∩ [0, p] in blocks of 64 keys
 * (one key per invocation for the score, one dim pair per invocation for the V sum) and writes (max, sum, Σ p·V).
 * With splits = 1 (prefill) it writes the normalized output directly and no merge pass runs.
 * head_dim <= 256 and even.
 */
export const attentionPartialWgsl = /* wgsl */ `
struct Params {
  kOffset: u32, vOffset: u32, pageWords: u32, pageTokens: u32,
  heads: u32, kvHeads: u32, headDim: u32, splits: u32,
  scale: f32, _p0: u32, _p1: u32, _p2: u32,
}

@group(0) @binding(0) var<storage, read> q: array<f32>;
@group(0) @binding(1) var<storage, read_write> dst: array<f32>;
@group(0) @binding(2) var<storage, read> pageTable: array<u32>;
@group(0) @binding(3) var<uniform> step: KvStep;
@group(0) @binding(4) var<uniform> params: Params;
${kvPagesWgsl('read', 5)}

const WG: u32 = 64u;
const NONE: f32 = -1e30;
var<workgroup> qs: array<vec2<f32>, 128>;
var<workgroup> probs: array<f32, WG>;

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
  let s = wg.x;
  let h = wg.y;
  let t = wg.z;
  if (t >= step.tokens) { return; }
  let pairs = params.headDim / 2u;
  let kvh = h / (params.heads / params.kvHeads);
  let visible = step.position + t + 1u;
  let chunk = (step.length + params.splits - 1u) / params.splits;
  let start = s * chunk;
  let end = min(start + chunk, visible);
  let qBase = (t * params.heads + h) * params.headDim;
  for (var i = lid; i < pairs; i += WG) {
    qs[i] = vec2<f32>(q[qBase + 2u * i], q[qBase + 2u * i + 1u]) * params.scale;
  }
  workgroupBarrier();

  let headBase = kvh * params.pageTokens * pairs;
  var m = NONE;
  var l = 0.0;
  var acc0 = vec2<f32>(0.0);
  var acc1 = vec2<f32>(0.0);
  for (var block = start; block < end; block += WG) {
    let key = block + lid;
    var score = NONE;
    if (key < end) {
      let entry = pageTable[step.tableOffset + key / params.pageTokens];
      let kBase = params.kOffset + headBase + (key % params.pageTokens) * pairs;
      var sum = 0.0;
      for (var w = 0u; w < pairs; w++) {
        sum += dot(qs[w], unpack2x16float(kvLoad(entry, kBase + w)));
      }
      score = sum;
    }
    probs[lid] = score;
    workgroupBarrier();
    let n = min(WG, end - block);
    var blockMax = m;
    for (var j = 0u; j < n; j++) { blockMax = max(blockMax, probs[j]); }
    workgroupBarrier();
    probs[lid] = exp(score - blockMax);
    workgroupBarrier();
    let correction = exp(m - blockMax);
    l *= correction;
    acc0 *= correction;
    acc1 *= correction;
    for (var j = 0u; j < n; j++) {
      let p = probs[j];
      l += p;
      let key_j = block + j;
      let entry = pageTable[step.tableOffset + key_j / params.pageTokens];
      let vBase = params.vOffset + headBase + (key_j % params.pageTokens) * pairs;
      if (lid < pairs) { acc0 += p * unpack2x16float(kvLoad(entry, vBase + lid)); }
      if (lid + WG < pairs) { acc1 += p * unpack2x16float(kvLoad(entry, vBase + lid + WG)); }
    }
    m = blockMax;
    workgroupBarrier();
  }

  if (params.splits == 1u) {
    if (lid < pairs) {
      dst[qBase + 2u * lid] = acc0.x / l;
      dst[qBase + 2u * lid + 1u] = acc0.y / l;
    }
    if (lid + WG < pairs) {
      dst[qBase + 2u * (lid + WG)] = acc1.x / l;
      dst[qBase + 2u * (lid + WG) + 1u] = acc1.y / l;
    }
  } else {
    let r = ((t * params.heads + h) * params.splits + s) * (params.headDim + 2u);
    if (lid == 0u) {
      dst[r] = m;
      dst[r + 1u] = l;
    }
    if (lid < pairs) {
      dst[r + 2u + 2u * lid] = acc0.x;
      dst[r + 3u + 2u * lid] = acc0.y;
    }
    if (lid + WG < pairs) {
      dst[r + 2u + 2u * (lid + WG)] = acc1.x;
      dst[r + 3u + 2u * (lid + WG)] = acc1.y;
    }
  }
}
`;

/**
 * Merges the splits' partial softmax results of one (head, query) into the output:
 * out = Σ_s e^(m_s − M)·acc_s / Σ_s e^(m_s − M)·l_s with M = max_s m_s. Empty splits carry m = −1e30, l = 0.
 */
export const attentionMergeWgsl = /* wgsl */ `
struct Params { heads: u32, headDim: u32, splits: u32, _p: u32 }
struct KvStep { position: u32, tokens: u32, tableOffset: u32, length: u32 }

@group(0) @binding(0) var<storage, read> partials: array<f32>;
@group(0) @binding(1) var<storage, read_write> out: array<f32>;
@group(0) @binding(2) var<uniform> step: KvStep;
@group(0) @binding(3) var<uniform> params: Params;

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
  let h = wg.x;
  let t = wg.y;
  if (t >= step.tokens) { return; }
  let rec = params.headDim + 2u;
  let base = (t * params.heads + h) * params.splits * rec;
  var best = -1e30;
  for (var s = 0u; s < params.splits; s++) { best = max(best, partials[base + s * rec]); }
  var total = 0.0;
  for (var s = 0u; s < params.splits; s++) {
    total += partials[base + s * rec + 1u] * exp(partials[base + s * rec] - best);
  }
  let outBase = (t * params.heads + h) * params.headDim;
  for (var d = lid; d < params.headDim; d += 64u) {
    var acc = 0.0;
    for (var s = 0u; s < params.splits; s++) {
      acc += partials[base + s * rec + 2u + d] * exp(partials[base + s * rec] - best);
    }
    out[outBase + d] = acc / total;
  }
}
`;
