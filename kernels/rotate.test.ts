import { describe, expect, it } from 'vitest';
import { releaseDispatches, submitDispatches, uniformBuffer } from '../core/gpu/dispatch.ts';
import { readFloat32 } from '../core/gpu/readback.ts';
import { withTestGpu } from '../test/gpu.ts';
import { maxToleranceRatio, randomFloats, seededRandom } from '../test/random.ts';
import { mutateShaders } from '../test/shader-mutation.ts';
import { rotateReference } from './reference/rotate.ts';
import { prepareRotate, type RotateBuild } from './rotate.ts';
import { ROTATE_PREFILL_LAYOUT, type RotateBlockLayout, rotateBlockTokens } from './rotate.wgsl.ts';

/** Layouts other than the runtime's: fewer invocations with more rows each, and more with fewer. */
const OTHER_LAYOUTS: RotateBlockLayout[] = [
  { invocations: 64, rowsPerInvocation: 16 },
  { invocations: 256, rowsPerInvocation: 4 },
];

const ctx = withTestGpu();

async function runRotate(
  tokens: number,
  maxTokens: number,
  heads: number,
  headDim: number,
  headsPerMatrix: number,
  transpose: boolean,
  build?: RotateBuild,
  /** A broken kernel: the build's code with this edit applied (it must change it). */
  mutation?: (code: string) => string,
) {
  const { gpu } = ctx;
  const broken = mutation ? mutateShaders(gpu, { label: /^rotate/, edit: mutation }) : null;
  const random = seededRandom(tokens * 13 + heads * 5 + headDim + (transpose ? 1 : 0));
  const matrices = 2 + heads / headsPerMatrix;
  const firstMatrix = 2;
  const x = randomFloats(random, maxTokens * heads * headDim, 2);
  const rotation = randomFloats(random, matrices * headDim * headDim, 1);
  const xb = gpu.allocator.createStorage('x', 'scratch', x);
  const rb = gpu.allocator.createStorage('r', 'kv', rotation);
  const step = uniformBuffer(gpu, 'step', [0, tokens, 0, 0], 'uuuu');
  const d = prepareRotate(
    broken?.gpu ?? gpu,
    'rotate-test',
    { parts: [{ x: xb, rotation: rb, firstMatrix, heads, headsPerMatrix, transpose }], step, maxTokens, headDim },
    build,
  );
  if (broken) expect(broken.mutated).toHaveLength(1);
  submitDispatches(gpu, 'rotate-test', [d]);
  const actual = await readFloat32(gpu, xb, x.length);
  releaseDispatches(gpu, [d]);
  for (const b of [xb, rb, step]) gpu.allocator.release(b);
  const rotated = rotateReference(x.subarray(0, tokens * heads * headDim), rotation, {
    tokens,
    heads,
    headDim,
    headsPerMatrix,
    firstMatrix,
    transpose,
  });
  const expected = Float32Array.from(x);
  expected.set(rotated); // rows past the step's token count stay untouched
  return { actual, expected };
}

describe('per-head rotation kernel', () => {
  it.each([
    [1, 1, 4, 8, 1, false],
    [3, 4, 8, 64, 4, false],
    [2, 2, 2, 128, 1, true],
    [5, 5, 14, 64, 7, true],
    // The widest head the kernel takes: several rounds of loads per invocation in both products.
    [1, 1, 2, 256, 1, false],
    [1, 1, 2, 256, 2, true],
    // More tokens than a block of the prefill build: whole blocks, and a last block the step's tokens end inside.
    [100, 130, 4, 64, 2, true],
    [32, 32, 2, 128, 1, false],
    [40, 48, 8, 128, 4, true],
    // Widths whose quads do not divide the prefill builds' invocations: some sit idle, some rows are spare.
    [17, 20, 2, 24, 1, false],
    [17, 20, 2, 40, 2, true],
  ] as const)(
    'matches the reference (%i of %i tokens, %i heads, head_dim %i, %i heads per matrix, transpose %s)',
    async (tokens, maxTokens, heads, headDim, hpm, transpose) => {
      // Every build, whichever maxTokens picks: the decode one (a row a workgroup, partial sums) and the prefill
      // ones (blocks of tokens a workgroup) in the runtime's layout and others.
      const builds: RotateBuild[] = [
        { blocks: false },
        ...[ROTATE_PREFILL_LAYOUT, ...OTHER_LAYOUTS].map((layout) => ({ blocks: true, layout })),
      ];
      for (const build of builds) {
        const { actual, expected } = await runRotate(tokens, maxTokens, heads, headDim, hpm, transpose, build);
        expect(maxToleranceRatio(actual, expected, 1e-4, 1e-4), JSON.stringify(build.layout)).toBeLessThanOrEqual(1);
      }
    },
  );

  it('rotates three tensors in one dispatch as three dispatches would (q, k with one rotation, v transposed with another)', async () => {
    const { gpu } = ctx;
    const random = seededRandom(77);
    const [tokens, maxTokens, headDim, kvHeads] = [3, 4, 64, 2];
    const shapes = [
      { heads: 8, transpose: false, rotation: 0 },
      { heads: kvHeads, transpose: false, rotation: 0 },
      { heads: kvHeads, transpose: true, rotation: 1 },
    ];
    const rotations = [0, 1].map(() => randomFloats(random, 3 * kvHeads * headDim * headDim, 1));
    const xs = shapes.map((s) => randomFloats(random, maxTokens * s.heads * headDim, 2));
    const rb = rotations.map((r) => gpu.allocator.createStorage('r', 'kv', r));
    const xb = xs.map((x) => gpu.allocator.createStorage('x', 'scratch', x));
    const step = uniformBuffer(gpu, 'step', [0, tokens, 0, 0], 'uuuu');
    const parts = shapes.map((s, i) => ({
      x: xb[i],
      rotation: rb[s.rotation],
      firstMatrix: 2,
      heads: s.heads,
      headsPerMatrix: s.heads / kvHeads,
      transpose: s.transpose,
    }));
    const d = prepareRotate(gpu, 'rotate3', { parts, step, maxTokens, headDim });
    submitDispatches(gpu, 'rotate3', [d]);
    for (const [i, s] of shapes.entries()) {
      const actual = await readFloat32(gpu, xb[i], xs[i].length);
      const expected = Float32Array.from(xs[i]);
      expected.set(
        rotateReference(xs[i].subarray(0, tokens * s.heads * headDim), rotations[s.rotation], {
          tokens,
          heads: s.heads,
          headDim,
          headsPerMatrix: s.heads / kvHeads,
          firstMatrix: 2,
          transpose: s.transpose,
        }),
      );
      expect(maxToleranceRatio(actual, expected, 1e-4, 1e-4), `part ${i}`).toBeLessThanOrEqual(1);
    }
    releaseDispatches(gpu, [d]);
    for (const b of [...xb, ...rb, step]) gpu.allocator.release(b);
  });

  it.each([ROTATE_PREFILL_LAYOUT, ...OTHER_LAYOUTS])(
    "catches a broken blocks build: every block rotating the first block's tokens (%o)",
    async (layout) => {
      const mutation = (code: string) =>
        code.replace(`let token = wg.y * ${rotateBlockTokens(64, layout)}u;`, 'let token = 0u;');
      const { actual, expected } = await runRotate(100, 130, 4, 64, 2, true, { blocks: true, layout }, mutation);
      expect(maxToleranceRatio(actual, expected, 1e-4, 1e-4)).toBeGreaterThan(1);
    },
  );

  it.each([
    ['the decode build', { blocks: false, layout: undefined }],
    ["the runtime's blocks build", { blocks: true, layout: ROTATE_PREFILL_LAYOUT }],
  ] as const)('catches a broken kernel (wrong matrix for grouped heads; %s)', async (_, { blocks, layout }) => {
    const mutation = (code: string) => code.replace('(head / part.y)', 'head');
    const { actual, expected } = await runRotate(2, 2, 8, 64, 4, false, { blocks, layout }, mutation);
    expect(maxToleranceRatio(actual, expected, 1e-4, 1e-4)).toBeGreaterThan(1);
  });
});
