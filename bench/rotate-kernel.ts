/**
 * The prefill rotation of the 2-bit cache (kernels/rotate.wgsl.ts, blocks build) timed by layout, for one layer of
 * each model shape: q, k and v rotated in one dispatch (`rotate_qkv`) and the attention's output un-rotated
 * (`unrotate_out`, the transposed product), over `--tokens` rows. On the H200 they took 5.4 and 4.3 ms of a
 * 1024-token Qwen3-4B chunk (220 ms, 36 layers; session 21), about 10 TFLOPS of f32 multiply-adds: that build staged
 * 16 KiB of rows in workgroup memory for 64 invocations, so few warps shared an SM (session 22 timed it here as
 * `staged`: bench/results/2026-12-01-nvidia-h200-session22-rotate-kernel*.json; removed since).
 *
 * Builds (named `direct-<invocations>x<rows per invocation>`): the runtime's layout (its output is the reference)
 * and layouts of other workgroup sizes and rows per invocation (variants: the same products in the same order, so they must write the
 * same words; their differing words and tolerance ratio are recorded, and a variant off by more than 1e-5 fails the
 * run); for the un-rotation also the products over a transposed copy of the matrices (`-transposedCopy`, what the
 * runtime's un-rotation reads since session 22: the same products in another order, checked to 1e-5); and
 * mutations the check must catch (`mut-`, not timed). Inputs are restored before each check; timing as
 * bench/attention-kernels.ts (the dispatch recorded n and 5n times). Exit code 1 if a build is off or a mutation is
 * not.
 *
 *   npx tsx bench/rotate-kernel.ts [--shapes qwen3-4b,llama-3.2-1b,qwen2.5-0.5b] [--tokens 1024] [--out FILE.json]
 * On the GPU host: bundled by `npm run bench:bundle` (.gpu/rotate-kernel.mjs).
 */
import { writeFileSync } from 'node:fs';
import { parseArgs } from 'node:util';
import { acquireGpu, type GpuContext } from '../core/gpu/device.ts';
import { releaseDispatches, submitDispatches, uniformBuffer } from '../core/gpu/dispatch.ts';
import { nodeGpu } from '../core/gpu/node.ts';
import { readFloat32 } from '../core/gpu/readback.ts';
import { prepareRotate, type RotateBuild, type RotatePart } from '../kernels/rotate.ts';
import { ROTATE_PREFILL_LAYOUT, type RotateBlockLayout } from '../kernels/rotate.wgsl.ts';
import { transposedMatrices } from '../runtime/kv/rotation.ts';
import { maxToleranceRatio, randomFloats, seededRandom } from '../test/random.ts';
import { mutateShaders } from '../test/shader-mutation.ts';
import { timeDispatches } from './gpu-timing.ts';
import { type LayerShape, layerShapesNamed, SHAPES_OPTION } from './models.ts';
import { edited } from './wgsl-edit.ts';

const LAYOUTS: { name: string; layout: RotateBlockLayout }[] = ([64, 128, 256] as const).flatMap((invocations) =>
  [4, 8, 16].map((rowsPerInvocation) => ({
    name: `direct-${invocations}x${rowsPerInvocation}`,
    layout: { invocations, rowsPerInvocation },
  })),
);

/** Tolerance of a build against the reference build: the same products, so at most rounding of a changed order. */
const TOLERANCE = 1e-5;

interface Case {
  name: string;
  /** Per part: heads, matrix set (0: keys', 1: values'), transpose. */
  parts: { heads: number; matrices: 0 | 1; transpose: boolean }[];
}

async function benchShape(gpu: GpuContext, shape: LayerShape, tokens: number): Promise<Record<string, unknown>[]> {
  const { heads, kvHeads, headDim } = shape;
  const random = seededRandom(11);
  // Entries of about 1/√d: products keep the rows' scale, so repeated in-place runs stay finite.
  const matrixScale = Math.sqrt(3 / headDim);
  const matrices = [0, 1].map(() => randomFloats(random, kvHeads * headDim * headDim, matrixScale));
  const transposed = matrices.map((m) => transposedMatrices(m, headDim));
  const matrixBuffers = matrices.map((m) => gpu.allocator.createStorage('bench', 'scratch', m));
  const transposedBuffers = transposed.map((m) => gpu.allocator.createStorage('bench', 'scratch', m));
  const step = uniformBuffer(gpu, 'step', [0, tokens, 0, 0], 'uuuu');
  const cases: Case[] = [
    {
      name: 'rotate_qkv',
      parts: [
        { heads, matrices: 0, transpose: false },
        { heads: kvHeads, matrices: 0, transpose: false },
        { heads: kvHeads, matrices: 1, transpose: false },
      ],
    },
    { name: 'unrotate_out', parts: [{ heads, matrices: 1, transpose: true }] },
  ];
  const rows: Record<string, unknown>[] = [];
  for (const c of cases) {
    const inputs = c.parts.map((p) => randomFloats(random, tokens * p.heads * headDim, 2));
    const xs = inputs.map((x) => gpu.allocator.createStorage('bench', 'scratch', x));
    // Transposed products read R column-wise ('original'), or a transposed copy row-wise ('transposedCopy'; the
    // mutation 'originalAsCopy' reads R row-wise as if it were the copy).
    type Matrices = 'original' | 'transposedCopy' | 'originalAsCopy';
    const parts = (matrices: Matrices): RotatePart[] =>
      c.parts.map((p, i) => ({
        x: xs[i],
        rotation: (p.transpose && matrices === 'transposedCopy' ? transposedBuffers : matrixBuffers)[p.matrices],
        firstMatrix: 0,
        heads: p.heads,
        headsPerMatrix: p.heads / kvHeads,
        transpose: p.transpose && matrices === 'original',
      }));
    const builds: { name: string; build: RotateBuild; matrices: Matrices; edit?: (code: string) => string }[] =
      LAYOUTS.map(({ name, layout }) => ({ name, build: { blocks: true, layout }, matrices: 'original' }));
    // Mutations the check must catch (not timed): the build's first row of each group read and stored at
    // the next; for the un-rotation, R read as if it were the transposed copy.
    const mutated = LAYOUTS.find((l) => l.name === 'direct-128x8')!.layout;
    builds.push({
      name: 'mut-direct-128x8-row',
      build: { blocks: true, layout: mutated },
      edit: (code) => edited(code, (c) => c.replaceAll('min(first + 0u, tokens - 1u)', 'min(first + 1u, tokens - 1u)')),
      matrices: 'original',
    });
    const transposing = c.parts.some((p) => p.transpose);
    if (transposing) {
      for (const name of ['direct-128x8', 'direct-256x8']) {
        const { build } = builds.find((b) => b.name === name)!;
        builds.push({ name: `${name}-transposedCopy`, build, matrices: 'transposedCopy' });
      }
      const { build } = builds.find((b) => b.name === 'direct-128x8')!;
      builds.push({ name: 'mut-direct-128x8-originalAsCopy', build, matrices: 'originalAsCopy' });
    }
    // The runtime's layout by value (its constant is not one of LAYOUTS' objects).
    const runtimeLayout = JSON.stringify(ROTATE_PREFILL_LAYOUT);
    const runtime = LAYOUTS.find((l) => JSON.stringify(l.layout) === runtimeLayout)?.name;
    if (runtime === undefined) throw new Error(`the runtime's layout ${runtimeLayout} is not among the layouts timed`);
    builds.sort((a, b) => Number(b.name === runtime) - Number(a.name === runtime));
    // The reference is the runtime's layout as such; the runtime's un-rotation reads the transposed copy with it.
    const row: Record<string, unknown> = {
      shape: shape.name,
      case: c.name,
      tokens,
      reference: runtime,
      runtime: transposing ? `${runtime}-transposedCopy` : runtime,
    };
    let reference: Float32Array[] | null = null;
    for (const { name, build, matrices, edit } of builds) {
      const on = edit ? mutateShaders(gpu, { label: /^rotate/, edit }).gpu : gpu;
      const dispatch = prepareRotate(on, name, { parts: parts(matrices), step, maxTokens: tokens, headDim }, build);
      xs.forEach((x, i) => {
        gpu.device.queue.writeBuffer(x, 0, inputs[i]);
      });
      submitDispatches(gpu, 'check', [dispatch]);
      const out = await Promise.all(xs.map((x, i) => readFloat32(gpu, x, inputs[i].length)));
      if (reference === null) {
        reference = out;
      } else {
        let differing = 0;
        let ratio = 0;
        out.forEach((o, i) => {
          const words = new Uint32Array(o.buffer, o.byteOffset, o.length);
          const ref = reference![i];
          const refWords = new Uint32Array(ref.buffer, ref.byteOffset, ref.length);
          for (let k = 0; k < words.length; k++) if (words[k] !== refWords[k]) differing++;
          ratio = Math.max(ratio, maxToleranceRatio(o, ref, TOLERANCE, TOLERANCE));
        });
        row[`${name}Differing`] = differing;
        row[`${name}Ratio`] = Math.round(ratio * 1000) / 1000;
        const mutation = name.startsWith('mut-');
        if (mutation ? ratio <= 1 : !(ratio <= 1)) process.exitCode = 1;
        if (mutation) {
          releaseDispatches(gpu, [dispatch]);
          continue;
        }
      }
      const ms = await timeDispatches(gpu, [dispatch], 20);
      row[`${name}Us`] = Math.round(ms * 10000) / 10;
      releaseDispatches(gpu, [dispatch]);
    }
    for (const x of xs) gpu.allocator.release(x);
    console.log(JSON.stringify(row));
    rows.push(row);
  }
  for (const b of [...matrixBuffers, ...transposedBuffers, step]) gpu.allocator.release(b);
  gpu.throwIfErrors();
  return rows;
}

const { values } = parseArgs({
  options: {
    shapes: SHAPES_OPTION,
    tokens: { type: 'string', default: '1024' },
    out: { type: 'string' },
  },
});
const tokens = Number(values.tokens);
if (!(Number.isInteger(tokens) && tokens >= 1)) throw new Error(`--tokens: a whole number, got ${values.tokens}`);
const gpu = await acquireGpu({ gpu: await nodeGpu() });
console.log(JSON.stringify({ adapter: gpu.adapter }));
const results: Record<string, unknown>[] = [];
for (const shape of layerShapesNamed(values.shapes)) {
  results.push(...(await benchShape(gpu, shape, tokens)));
}
if (values.out) writeFileSync(values.out, `${JSON.stringify({ adapter: gpu.adapter, tokens, results }, null, 1)}\n`);
gpu.device.destroy();
