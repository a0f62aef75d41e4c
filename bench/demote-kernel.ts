/**
 * Where the KV demotion's time goes (kernels/kv-demote.wgsl.ts). On the H200 it took 7.4 ms of a 1024-token prefill
 * chunk of Qwen3-4B with the 2-bit cache (207 µs a layer for ~2,000 rows of 1,024 values: session 21), about what
 * that model's 2-bit prefill at 8K lacks for 0.5× llama.cpp; by instruction count its rank loop explains a fraction.
 *
 * For each layer shape: a one-layer quant pool, two steps of `--tokens` appended, then a third planned, so the pool's
 * jobs buffer holds a long prefill's demotions (every page of the second step).
 * Every build runs on the same slabs, restored before each run: as built (its output is the reference), the variants
 * (checked word for word against it: a demotion must write exactly what quantizeRow computes; exit code 1 if one
 * differs), then the ablations (wrong by design, timed; their differing words are recorded, which shows the check
 * can fail). Timing as bench/attention-kernels.ts: the one dispatch recorded n and 5n times.
 *
 *   npx tsx bench/demote-kernel.ts [--shapes qwen3-4b,llama-3.2-1b,qwen2.5-0.5b] [--tokens 1024] [--clip 1]
 *                                  [--out FILE.json]
 * (--clip: the formats' clipQuantile; the runtime's default 1 is plain min/max, which the minmax-scan build serves;
 * below 1 it keeps the rank loop.)
 * On the GPU host: bundled by `npm run bench:bundle` (.gpu/demote-kernel.mjs).
 */
import { writeFileSync } from 'node:fs';
import { parseArgs } from 'node:util';
import { releaseDispatches, submitDispatches } from '../kernels/dispatch.ts';
import { prepareKvDemote } from '../kernels/kv-demote.ts';
import { kvDemoteWgsl } from '../kernels/kv-demote.wgsl.ts';
import { acquireGpu, type GpuContext } from '../runtime/gpu/device.ts';
import { nodeGpu } from '../runtime/gpu/node.ts';
import { readBuffer } from '../runtime/gpu/readback.ts';
import { PagedKvAttention } from '../runtime/kv/paged-attention.ts';
import { KvPagePool } from '../runtime/kv/pool.ts';
import { randomFloats, seededRandom } from '../test/random.ts';
import { timeDispatches } from './gpu-timing.ts';
import { edited } from './wgsl-edit.ts';

interface LayerShape {
  name: string;
  heads: number;
  kvHeads: number;
  headDim: number;
}

const SHAPES: LayerShape[] = [
  { name: 'qwen3-4b', heads: 32, kvHeads: 8, headDim: 128 },
  { name: 'llama-3.2-1b', heads: 32, kvHeads: 8, headDim: 64 },
  { name: 'qwen2.5-0.5b', heads: 14, kvHeads: 2, headDim: 64 },
];

/** The rank loop of the kernel as built: from its first line to the barrier after it. */
const RANK_LOOP =
  /\n {2}\/\/ Values i, i \+ WG[\s\S]*?\n {2}for \(var i0 = lid;[\s\S]*?\n {2}\}\n(?= {2}workgroupBarrier\(\);\n {2}let maxCode)/;

/**
 * Plain min/max (clipQuantile 1: ranks 0 and n − 1) by scans instead of ranks: each group's values split into spans,
 * one span an invocation, then one invocation a group merges its spans in order. Bit-identical to the ranks: rank 0
 * is the first occurrence of the minimum (strict <, spans in order), rank n − 1 the last occurrence of the maximum
 * (>=), which matters only for −0 against +0. Other quantiles keep the rank loop.
 */
function minMaxScan(code: string): string {
  const withArrays = edited(
    code,
    (c) =>
      c.replace(
        'var<workgroup> groupParam:',
        'var<workgroup> spanLo: array<f32, 256>;\nvar<workgroup> spanHi: array<f32, 256>;\nvar<workgroup> groupParam:',
      ),
    'min/max arrays',
  );
  return edited(
    withArrays,
    (c) =>
      c.replace(
        RANK_LOOP,
        (rankLoop) => `
  let groupCount = params.width / size;
  if (f.loRank == 0u && f.hiRank == size - 1u) {
    // Spans of ceil(size / spans) values; the last ones of a group may be empty.
    let spans = min(max(1u, WG / groupCount), size);
    let spanSize = (size + spans - 1u) / spans;
    let g = lid / spans;
    if (g < groupCount) {
      let first = g * size + (lid % spans) * spanSize;
      let end = min(first + spanSize, (g + 1u) * size);
      if (first < end) {
        var lo = vals[first];
        var hi = lo;
        for (var j = first + 1u; j < end; j++) {
          let u = vals[j];
          if (u < lo) { lo = u; }
          if (u >= hi) { hi = u; }
        }
        spanLo[lid] = lo;
        spanHi[lid] = hi;
      }
    }
    workgroupBarrier();
    if (lid < groupCount) {
      var lo = spanLo[lid * spans];
      var hi = spanHi[lid * spans];
      for (var s = 1u; s < spans && s * spanSize < size; s++) {
        let u = spanLo[lid * spans + s];
        let w = spanHi[lid * spans + s];
        if (u < lo) { lo = u; }
        if (w >= hi) { hi = w; }
      }
      groupLo[lid] = lo;
      groupHi[lid] = hi;
    }
  } else {${rankLoop.replaceAll('\n', '\n  ')}
  }
`,
      ),
    'min/max scan',
  );
}

interface Build {
  name: string;
  source: string;
  /** Wrong by design: timed, not checked. */
  ablation?: boolean;
}

const BUILDS: Build[] = [
  { name: 'built', source: kvDemoteWgsl },
  { name: 'minmax-scan', source: minMaxScan(kvDemoteWgsl) },
  // Ablations: no ranks (groupLo/groupHi keep whatever they held); no coding (no code words written); the f16 rows
  // not read (values from their index); every workgroup returning after its job check (the dispatch's floor).
  {
    name: 'abl-noRank',
    source: edited(kvDemoteWgsl, (c) =>
      c.replace('for (var j = 0u; j < size; j++) {', 'for (var j = 0u; j < 0u; j++) {'),
    ),
    ablation: true,
  },
  {
    name: 'abl-noCode',
    source: edited(kvDemoteWgsl, (c) =>
      c.replace('for (var w = lid; w < f.codeWords; w += WG) {', 'for (var w = lid; w < 0u; w += WG) {'),
    ),
    ablation: true,
  },
  {
    name: 'abl-noLoad',
    source: edited(kvDemoteWgsl, (c) =>
      c.replace(
        'vals[i] = unpack2x16float(word)[d % 2u];',
        'vals[i] = f32((i * 37u + t) % 255u) * 0.01; if (word == 0xfffffffeu && h == 999u) { vals[i] = 1.0; }',
      ),
    ),
    ablation: true,
  },
  {
    name: 'abl-exit',
    source: edited(kvDemoteWgsl, (c) =>
      c.replace(
        'if (job >= jobs[0] || job >= params.maxJobs) { return; }',
        'if (job >= jobs[0] || job >= params.maxJobs || params.width > 0u) { return; }',
      ),
    ),
    ablation: true,
  },
];

/** The slabs the kernels bind, less the placeholders of unused slots (which have no copy usage). */
function slabs(pool: KvPagePool): GPUBuffer[] {
  return pool.slabBindings().filter((slab) => (slab.usage & GPUBufferUsage.COPY_SRC) !== 0);
}

async function readSlabs(gpu: GpuContext, pool: KvPagePool): Promise<Uint32Array<ArrayBuffer>[]> {
  return Promise.all(slabs(pool).map(async (slab) => new Uint32Array(await readBuffer(gpu, slab, slab.size))));
}

function writeSlabs(gpu: GpuContext, pool: KvPagePool, contents: Uint32Array<ArrayBuffer>[]): void {
  slabs(pool).forEach((slab, i) => {
    gpu.device.queue.writeBuffer(slab, 0, contents[i]);
  });
}

async function benchShape(
  gpu: GpuContext,
  shape: LayerShape,
  tokens: number,
  clipQuantile: number,
): Promise<Record<string, unknown>> {
  const { heads, kvHeads, headDim } = shape;
  const pool = new KvPagePool(gpu, {
    layers: 1,
    kvHeads,
    headDim,
    pageTokens: 16,
    kv: 'quant',
    keyFormat: { clipQuantile },
    valueFormat: { clipQuantile },
    maxStepTokens: tokens,
    budgetBytes: 3 * tokens * kvHeads * headDim * 4 + (16 << 20),
    maxSequences: 1,
  });
  const buffer = (floats: number) => gpu.allocator.createStorage('bench', 'scratch', floats * 4);
  const q = buffer(tokens * heads * headDim);
  const k = buffer(tokens * kvHeads * headDim);
  const v = buffer(tokens * kvHeads * headDim);
  const output = buffer(tokens * heads * headDim);
  const random = seededRandom(7);
  for (const [target, scale] of [
    [k, 2],
    [v, 1],
  ] as const) {
    const data = randomFloats(random, tokens * kvHeads * headDim, scale);
    gpu.device.queue.writeBuffer(target, 0, data.buffer, data.byteOffset, data.byteLength);
  }
  const layer = new PagedKvAttention(gpu, pool, { heads }).prepareLayer(0, { q, k, v, output }, tokens);
  const seq = pool.createSequence();
  // Two steps run (the second demotes the first's pages past the sink), the third is only planned: its demotions,
  // all of the second step's pages once the window has moved past them, are in the jobs buffer, as in a long prefill.
  for (const position of [0, tokens]) {
    pool.writeStep(seq, position, tokens);
    submitDispatches(gpu, 'step', layer.append);
  }
  pool.writeStep(seq, 2 * tokens, tokens);
  const jobs = pool.stepDemotions;
  if (jobs === 0)
    throw new Error(`--tokens ${tokens} demotes nothing: the first step must pass the f16 sink and window`);
  const before = await readSlabs(gpu, pool);
  const row: Record<string, unknown> = {
    shape: shape.name,
    tokens,
    clipQuantile,
    jobs,
    rows: jobs * 2 * pool.pageTokens,
  };
  let reference: Uint32Array<ArrayBuffer>[] | null = null;
  for (const build of BUILDS) {
    const dispatch = prepareKvDemote(gpu, build.name, { pool, layer: 0, source: build.source });
    // Every build runs on the restored slabs; the ablations' mismatches are recorded too (they should have some:
    // the check can fail).
    writeSlabs(gpu, pool, before);
    submitDispatches(gpu, 'check', [dispatch]);
    const after = await readSlabs(gpu, pool);
    const differing = (a: Uint32Array<ArrayBuffer>[], b: Uint32Array<ArrayBuffer>[]) =>
      a.reduce((n, slab, s) => n + slab.reduce((m, word, i) => m + (word === b[s][i] ? 0 : 1), 0), 0);
    if (reference === null) {
      reference = after;
      row.wordsWritten = differing(after, before);
      if (row.wordsWritten === 0) throw new Error(`${shape.name}: the built demotion changed no word`);
    } else {
      const mismatched = differing(after, reference);
      row[`${build.name}Mismatched`] = mismatched;
      if (mismatched > 0 && !build.ablation) process.exitCode = 1;
    }
    const ms = await timeDispatches(gpu, [dispatch], 20);
    row[`${build.name}Us`] = Math.round(ms * 10000) / 10;
    releaseDispatches(gpu, [dispatch]);
  }
  releaseDispatches(gpu, [...layer.append, ...layer.attention]);
  for (const b of [q, k, v, output]) gpu.allocator.release(b);
  pool.destroy();
  gpu.throwIfErrors();
  return row;
}

const { values } = parseArgs({
  options: {
    shapes: { type: 'string', default: SHAPES.map((s) => s.name).join(',') },
    tokens: { type: 'string', default: '1024' },
    clip: { type: 'string', default: '1' },
    out: { type: 'string' },
  },
});
const tokens = Number(values.tokens);
if (!(Number.isInteger(tokens) && tokens >= 16))
  throw new Error(`--tokens: a whole number of at least 16, got ${values.tokens}`);
const clipQuantile = Number(values.clip);
const gpu = await acquireGpu({ gpu: await nodeGpu() });
console.log(JSON.stringify({ adapter: gpu.adapter }));
const results: Record<string, unknown>[] = [];
for (const shape of SHAPES.filter((s) => values.shapes.split(',').includes(s.name))) {
  const row = await benchShape(gpu, shape, tokens, clipQuantile);
  console.log(JSON.stringify(row));
  results.push(row);
}
if (values.out)
  writeFileSync(values.out, `${JSON.stringify({ adapter: gpu.adapter, tokens, clipQuantile, results }, null, 1)}\n`);
gpu.device.destroy();
