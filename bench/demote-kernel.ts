/**
 * Where the KV demotion's time goes (kernels/kv-demote.wgsl.ts). On the H200 it took 7.4 ms of a 1024-token prefill
 * chunk of Qwen3-4B with the 2-bit cache (207 µs a layer for ~2,000 rows of 1,024 values: session 21), about what
 * that model's 2-bit prefill at 8K lacks for 0.5× llama.cpp. That was its rank loop; since session 22 the kernel
 * finds plain min/max (clip quantile 1) by scans, and the rank loop is a variant here.
 *
 * For each layer shape: a one-layer quant pool, two steps of `--tokens` appended, then a third planned, so the pool's
 * jobs buffer holds a long prefill step's demotions (the `--tokens` / 16 pages that left the window since).
 * The K and V values have ties (test/random.ts withTies): a min/max build's choice among equal values shows in the
 * bits (−0 against +0).
 * Every build runs on the same slabs, restored before each run: as built (its output is the reference), the variants
 * (checked word for word against it: a demotion must write exactly what quantizeRow computes), mutations (which must
 * differ: the check can fail), then the ablations (wrong by design, timed; their differing words are recorded). Exit
 * code 1 if a variant differs or a mutation does not. Timing as bench/attention-kernels.ts: the one dispatch recorded
 * n and 5n times.
 *
 *   npx tsx bench/demote-kernel.ts [--shapes qwen3-4b,llama-3.2-1b,qwen2.5-0.5b] [--tokens 1024] [--clip 1]
 *                                  [--out FILE.json]
 * (--clip: the formats' clipQuantile; the runtime's default 1 is plain min/max, which the kernel finds by scans,
 * checked word for word against its rank loop; below 1 it takes the rank loop, and the mutation is skipped.)
 * On the GPU host: bundled by `npm run bench:bundle` (.gpu/demote-kernel.mjs).
 */
import { writeFileSync } from 'node:fs';
import { parseArgs } from 'node:util';
import { acquireGpu, type GpuContext } from '../core/gpu/device.ts';
import { releaseDispatches, submitDispatches } from '../core/gpu/dispatch.ts';
import { nodeGpu } from '../core/gpu/node.ts';
import { readBuffer } from '../core/gpu/readback.ts';
import { prepareKvDemote } from '../kernels/kv-demote.ts';
import { PagedKvAttention } from '../runtime/kv/paged-attention.ts';
import { KvPagePool } from '../runtime/kv/pool.ts';
import { randomFloats, seededRandom, withTies } from '../test/random.ts';
import { mutateShaders } from '../test/shader-mutation.ts';
import { timeDispatches } from './gpu-timing.ts';
import { type LayerShape, layerShapesNamed, SHAPES_OPTION } from './models.ts';

/** The kernel's test for plain min/max, which takes the scans instead of the rank loop. */
const SCAN_CONDITION = 'if (f.loRank == 0u && f.hiRank == size - 1u) {';

interface Build {
  name: string;
  /** The edit of the kernel's WGSL (kv-demote.wgsl.ts) this build compiles; none for the kernel as built. */
  edit?: (code: string) => string;
  /**
   * 'variant' (default): must write the reference's words; 'mutation': a deliberate error the check must see (not
   * timed); 'ablation': wrong by design, timed, its differing words recorded.
   */
  kind?: 'variant' | 'mutation' | 'ablation';
}

const BUILDS: Build[] = [
  { name: 'built' },
  // The rank loop at every clip quantile (the kernel before session 22): must write what the scans write.
  { name: 'rank-loop', edit: (c) => c.replace(SCAN_CONDITION, 'if (false) {') },
  // The scans' minimum taking the last of equal values instead of the first, in the spans and in their merge:
  // differs only between −0 and +0. (The maximum's choice shows only through hi − lo, the same for −0 and +0
  // unless the whole group is zeros, which this data does not have: no such mutation could fail the check.)
  {
    name: 'mut-lastMin',
    edit: (c) => c.replaceAll('if (u < lo) { lo = u; loAt = j; }', 'if (u <= lo) { lo = u; loAt = j; }'),
    kind: 'mutation',
  },
  // Ablations: no min/max (groupLo/groupHi keep whatever they held); no coding (no code words written); the f16 rows
  // not read (values from their index); every workgroup returning after its job check (the dispatch's floor).
  {
    name: 'abl-noMinMax',
    // Neither the scans nor the rank loop run: they sit in branches never taken.
    edit: (c) => c.replace(SCAN_CONDITION, 'if (true) {} else if (false) {'),
    kind: 'ablation',
  },
  {
    name: 'abl-noCode',
    edit: (c) => c.replace('for (var w = lid; w < f.codeWords; w += WG) {', 'for (var w = lid; w < 0u; w += WG) {'),
    kind: 'ablation',
  },
  {
    name: 'abl-noLoad',
    edit: (c) =>
      c.replace(
        'vals[i] = unpack2x16float(word)[d % 2u];',
        'vals[i] = f32((i * 37u + t) % 255u) * 0.01; if (word == 0xfffffffeu && h == 999u) { vals[i] = 1.0; }',
      ),
    kind: 'ablation',
  },
  {
    name: 'abl-exit',
    edit: (c) =>
      c.replace(
        'if (job >= jobs[0] || job >= params.maxJobs) { return; }',
        'if (job >= jobs[0] || job >= params.maxJobs || params.width > 0u) { return; }',
      ),
    kind: 'ablation',
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
  const f16Bytes = (3 * tokens + 512) * kvHeads * headDim * 4;
  const pool = new KvPagePool(gpu, {
    layers: 1,
    kvHeads,
    headDim,
    pageTokens: 16,
    kv: 'quant',
    keyFormat: { clipQuantile },
    valueFormat: { clipQuantile },
    maxStepTokens: tokens,
    // f16 pages for all three steps (K and V, 2 bytes a value): the default share, at most half the budget, holds
    // only one step past the sink and window.
    f16BudgetBytes: f16Bytes,
    budgetBytes: 2 * f16Bytes + (16 << 20),
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
    withTies(data, kvHeads * headDim);
    gpu.device.queue.writeBuffer(target, 0, data.buffer, data.byteOffset, data.byteLength);
  }
  const layer = new PagedKvAttention(gpu, pool, { heads }).prepareLayer(0, { q, k, v, output }, tokens, null);
  const seq = pool.createSequence();
  // Two steps run (the second demotes the first's pages past the sink and window), the third is only planned: its
  // demotions, the pages that left the window since, are in the jobs buffer, as in a long prefill.
  for (const position of [0, tokens]) {
    pool.writeStep(seq, position, tokens);
    pool.submitPending(); // page copies and promotions the step asked for
    submitDispatches(gpu, 'step', layer.append);
  }
  pool.writeStep(seq, 2 * tokens, tokens);
  pool.submitPending(); // page copies and promotions the step asked for
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
  const differing = (a: Uint32Array<ArrayBuffer>[], b: Uint32Array<ArrayBuffer>[]) =>
    a.reduce((n, slab, s) => n + slab.reduce((m, word, i) => m + (word === b[s][i] ? 0 : 1), 0), 0);
  for (const build of BUILDS) {
    const kind = build.kind ?? 'variant';
    // The mutation edits the min/max scans, which only clip quantile 1 takes.
    if (kind === 'mutation' && clipQuantile !== 1) continue;
    // An edited build compiles on a view of the device whose kv-demote module is the edited code (mutateShaders
    // throws where an edit no longer changes the kernel).
    const view = build.edit ? mutateShaders(gpu, { label: 'kv-demote', edit: build.edit }) : null;
    const dispatch = prepareKvDemote(view?.gpu ?? gpu, build.name, { pool, layer: 0 });
    if (view && view.mutated.length !== 1) throw new Error(`${build.name}: the edited kernel was not what compiled`);
    writeSlabs(gpu, pool, before);
    submitDispatches(gpu, 'check', [dispatch]);
    const after = await readSlabs(gpu, pool);
    if (reference === null) {
      reference = after;
      row.wordsWritten = differing(after, before);
      if (row.wordsWritten === 0) throw new Error(`${shape.name}: the built demotion changed no word`);
    } else {
      const mismatched = differing(after, reference);
      row[`${build.name}Mismatched`] = mismatched;
      if ((kind === 'variant' && mismatched > 0) || (kind === 'mutation' && mismatched === 0)) process.exitCode = 1;
    }
    if (kind !== 'mutation') {
      const ms = await timeDispatches(gpu, [dispatch], 20);
      row[`${build.name}Us`] = Math.round(ms * 10000) / 10;
    }
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
    shapes: SHAPES_OPTION,
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
for (const shape of layerShapesNamed(values.shapes)) {
  const row = await benchShape(gpu, shape, tokens, clipQuantile);
  console.log(JSON.stringify(row));
  results.push(row);
}
if (values.out)
  writeFileSync(values.out, `${JSON.stringify({ adapter: gpu.adapter, tokens, clipQuantile, results }, null, 1)}\n`);
gpu.device.destroy();
