/**
 * Fuzzing the LOADER (issue 9): damaged copies of stories260K (truncations, bit flips in the header, the tensor table
 * and the tensor data, huge counts and lengths, wrong value types) go through ModelRunner.load. Each must load or throw a
 * LongtabError subclass, in bounded time, reading no more than the file and allocating bounded GPU memory; a failed
 * load leaves no GPU buffer behind, and the engine still loads the real model and reproduces its golden ids afterwards.
 * Counterexamples are written to tmp/faults/ as (offset, bytes) patches; keep them in test/regressions/loader/, which
 * the second test replays.
 */
import { createHash } from 'node:crypto';
import { readFileSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import fc from 'fast-check';
import { describe, expect, it } from 'vitest';
import { LongtabError } from '../../core/errors.ts';
import type { ByteSource } from '../../core/gguf-types.ts';
import { withTestGpu } from '../../test/gpu.ts';
import { describeError, FAULTS_DIR, faultLog } from '../../test/regressions/fault-log.ts';
import {
  applyMutation,
  bytesToHex,
  type HeaderFields,
  LOADER_REGRESSIONS_DIR,
  loaderRegressions,
  locateHeaderFields,
  type ModelMutation,
  u32Hex,
  u64Hex,
} from '../../test/regressions/mutations.ts';
import { STORIES260K, STORIES260K_GOLDEN, sharedPath } from '../../test/shared.ts';
import { parseGguf } from '../gguf/parse.ts';
import { sourceFromBytes } from '../gguf/sources.ts';
import { ModelRunner } from './model-runner.ts';

const ctx = withTestGpu();
const modelPath = sharedPath(STORIES260K);
const goldenPath = sharedPath(STORIES260K_GOLDEN);
const log = faultLog('loader');

/** Runs per mutation kind; LONGTAB_FUZZ_RUNS raises it for a longer hunt, LONGTAB_FUZZ_SEED replays one. */
const RUNS = Number(process.env.LONGTAB_FUZZ_RUNS ?? 8);
const SEED = Number(process.env.LONGTAB_FUZZ_SEED ?? 9);
/** A load of a 1 MB model that takes longer than this is hung, not slow. */
const LOAD_DEADLINE_MS = 60_000;
/** GPU bytes any load of a ≤ 1.2 MB file may hold at once: weights + a 1 MiB KV budget + scratch, with room to spare. */
const GPU_PEAK_LIMIT = 48 << 20;
const LOAD_OPTIONS = { kvBudgetBytes: 1 << 20 } as const;

const HUGE_U64 = [2n ** 31n, 2n ** 32n - 1n, 2n ** 32n, 2n ** 40n, 2n ** 53n, 2n ** 63n, 2n ** 64n - 1n];
const HUGE_U32 = [0, 1, 3, 2 ** 15, 2 ** 16 + 1, 2 ** 24, 2 ** 31, 2 ** 32 - 1];

/** Every mutation kind the fuzzer draws from, as fast-check arbitraries over the real file's layout. */
function mutationKinds(original: Uint8Array, dataOffset: number, fields: HeaderFields) {
  const flip = (offset: number, bit: number) => ({
    offset,
    hex: bytesToHex(Uint8Array.of(original[offset] ^ (1 << bit))),
  });
  const flips = (min: number, max: number, label: string) =>
    fc
      .array(fc.record({ offset: fc.integer({ min, max }), bit: fc.integer({ min: 0, max: 7 }) }), {
        minLength: 1,
        maxLength: 4,
      })
      .map(
        (list): ModelMutation => ({
          description: `${label}: bits flipped at ${list.map((f) => `${f.offset}.${f.bit}`).join(', ')}`,
          patches: list.map((f) => flip(f.offset, f.bit)),
        }),
      );
  const numericKeys = [...fields.keys].filter(
    ([, at]) => new DataView(original.buffer).getUint32(at.typeAt, true) === 4,
  );
  const tensorFields = [...fields.tensors];
  return {
    truncation: fc
      .integer({ min: 0, max: original.length - 1 })
      .map((n): ModelMutation => ({ description: `truncated to ${n} bytes`, truncate: n, patches: [] })),
    'header bit flips': flips(0, dataOffset - 1, 'header'),
    'tensor data bit flips': flips(dataOffset, original.length - 1, 'tensor data'),
    'huge count or length (u64)': fc
      .tuple(
        fc.constantFrom(...fields.lengths),
        fc.oneof(fc.constantFrom(...HUGE_U64), fc.bigInt({ min: 0n, max: 2n ** 64n - 1n })),
      )
      .map(
        ([offset, value]): ModelMutation => ({
          description: `u64 length/count at ${offset} set to ${value}`,
          patches: [{ offset, hex: u64Hex(value) }],
        }),
      ),
    'hyperparameter out of range (u32)': fc
      .tuple(fc.constantFrom(...numericKeys), fc.oneof(fc.constantFrom(...HUGE_U32), fc.nat()))
      .map(
        ([[key, at], value]): ModelMutation => ({
          description: `${key} set to ${value}`,
          patches: [{ offset: at.valueAt, hex: u32Hex(value) }],
        }),
      ),
    'wrong metadata value type': fc.tuple(fc.constantFrom(...fields.keys), fc.integer({ min: 0, max: 16 })).map(
      ([[key, at], type]): ModelMutation => ({
        description: `value type of ${key} set to ${type}`,
        patches: [{ offset: at.typeAt, hex: u32Hex(type) }],
      }),
    ),
    'tensor table entry': fc
      .tuple(
        fc.constantFrom(...tensorFields),
        fc.constantFrom('dimCount', 'dim0', 'type', 'offset'),
        fc.oneof(fc.constantFrom(0, 1, 2, 3, 5, 8, 30, 39, 2 ** 16, 2 ** 31), fc.nat()),
      )
      .map(([[name, at], field, value]): ModelMutation => {
        const patch =
          field === 'dimCount'
            ? { offset: at.dimCountAt, hex: u32Hex(value) }
            : field === 'type'
              ? { offset: at.typeAt, hex: u32Hex(value) }
              : { offset: field === 'dim0' ? at.dimsAt : at.offsetAt, hex: u64Hex(BigInt(value)) };
        return { description: `tensor ${name}: ${field} set to ${value}`, patches: [patch] };
      }),
  };
}

/** Records the largest single read, to prove no length field turned into a large allocation. */
function countingSource(bytes: Uint8Array): ByteSource & { largestRead: number } {
  const inner = sourceFromBytes(bytes, 'fuzzed-stories260K.gguf');
  const source = {
    name: inner.name,
    size: inner.size,
    largestRead: 0,
    read(offset: number, length: number) {
      source.largestRead = Math.max(source.largestRead, length);
      return inner.read(offset, length);
    },
  };
  return source;
}

function withDeadline<T>(work: Promise<T>, ms: number, what: string): Promise<T> {
  let timer: ReturnType<typeof setTimeout> | undefined;
  const deadline = new Promise<never>((_, reject) => {
    timer = setTimeout(() => reject(new Error(`${what} did not finish within ${ms} ms`)), ms);
  });
  return Promise.race([work, deadline]).finally(() => clearTimeout(timer));
}

/**
 * Loads one mutated file and checks the contract; returns the outcome in words. A successfully loaded model must also
 * generate (ids inside the vocabulary) and unload.
 */
async function loadMutated(engine: ModelRunner, original: Uint8Array, mutation: ModelMutation): Promise<string> {
  const gpu = engine.gpu;
  const baseline = gpu.allocator.snapshot();
  const source = countingSource(applyMutation(original, mutation));
  // The allocator's peak is for the device's whole life; this load's own peak is tracked at each allocation.
  const allocator = gpu.allocator;
  const createBuffer = allocator.createBuffer;
  let peak = baseline.totalBytes;
  allocator.createBuffer = (request) => {
    const buffer = createBuffer.call(allocator, request);
    peak = Math.max(peak, allocator.totalBytes());
    return buffer;
  };
  let outcome: string;
  try {
    await withDeadline(engine.load(source, LOAD_OPTIONS), LOAD_DEADLINE_MS, 'engine.load');
    const result = await withDeadline(
      engine.generate({ promptIds: [engine.tokenizer.bosId ?? 0], maxTokens: 3, stopAtEog: false }),
      LOAD_DEADLINE_MS,
      'generate',
    );
    for (const id of result.ids) expect(id).toBeLessThan(engine.config.vocab);
    engine.unload();
    outcome = 'loaded';
  } catch (error) {
    if (!(error instanceof LongtabError)) {
      throw new Error(`${mutation.description}: threw ${describeError(error)} (${String(error)}), not a LongtabError`);
    }
    expect(error.message.length).toBeGreaterThan(20);
    outcome = describeError(error);
  } finally {
    allocator.createBuffer = createBuffer;
  }
  await gpu.device.queue.onSubmittedWorkDone();
  const after = gpu.allocator.snapshot();
  expect(after.totalBuffers, `${mutation.description}: GPU buffers left behind`).toBe(baseline.totalBuffers);
  expect(after.totalBytes, `${mutation.description}: GPU bytes left behind`).toBe(baseline.totalBytes);
  expect(peak, `${mutation.description}: GPU memory peak`).toBeLessThanOrEqual(GPU_PEAK_LIMIT);
  expect(source.largestRead, `${mutation.description}: largest read`).toBeLessThanOrEqual(original.length);
  expect(
    gpu.errors.map((e) => e.message),
    `${mutation.description}: WebGPU errors`,
  ).toEqual([]);
  return outcome;
}

/** Keeps a counterexample where a person can move it into test/regressions/loader/. */
function saveCounterexample(mutation: ModelMutation): string {
  const json = `${JSON.stringify(mutation, null, 2)}\n`;
  const name = `loader-${createHash('sha256').update(json).digest('hex').slice(0, 10)}.json`;
  writeFileSync(join(FAULTS_DIR, name), json);
  return join(FAULTS_DIR, name);
}

async function expectGolden(
  engine: ModelRunner,
  modelBytes: Uint8Array,
  golden: { greedy_ids: number[] },
): Promise<void> {
  await engine.load(sourceFromBytes(modelBytes, 'stories260K.gguf'), LOAD_OPTIONS);
  const expected = golden.greedy_ids.slice(1);
  const result = await engine.generate({
    promptIds: [golden.greedy_ids[0]],
    maxTokens: expected.length,
    stopAtEog: false,
  });
  expect(result.ids).toEqual(expected);
  engine.unload();
}

describe.skipIf(!modelPath || !goldenPath)('ModelRunner.load on damaged stories260K files', () => {
  it(`fuzzed mutations (${RUNS} per kind, seed ${SEED}) load or throw a LongtabError, leaving no GPU buffer behind`, async () => {
    const original = new Uint8Array(readFileSync(modelPath!));
    const golden = JSON.parse(readFileSync(goldenPath!, 'utf8')) as { greedy_ids: number[] };
    const file = await parseGguf(sourceFromBytes(original));
    const kinds = mutationKinds(original, file.dataOffset, locateHeaderFields(original, file));
    const engine = new ModelRunner(ctx.gpu);
    const baseline = ctx.gpu.allocator.snapshot();
    for (const [kind, arbitrary] of Object.entries(kinds)) {
      const outcomes = new Map<string, number>();
      let failure: string | null = null;
      try {
        await fc.assert(
          fc.asyncProperty(arbitrary, async (mutation) => {
            try {
              const outcome = await loadMutated(engine, original, mutation);
              outcomes.set(outcome, (outcomes.get(outcome) ?? 0) + 1);
            } catch (error) {
              engine.unload();
              saveCounterexample(mutation);
              throw error;
            }
          }),
          { numRuns: RUNS, seed: SEED, endOnFailure: true },
        );
      } catch (error) {
        failure = String(error);
      }
      log.record({
        area: 'loader',
        fault: `${kind} of stories260K (fast-check, seed ${SEED})`,
        expected: 'loads, or throws a LongtabError; GPU buffers back to baseline; reads ≤ file size',
        outcome: failure ? `FAILED: ${failure.split('\n')[0]}` : [...outcomes].map(([o, n]) => `${o} ×${n}`).join('; '),
        ok: failure === null,
        count: RUNS,
      });
      if (failure) throw new Error(`${kind}: ${failure}\nCounterexamples are in ${FAULTS_DIR}.`);
    }
    expect(ctx.gpu.allocator.snapshot().totalBuffers).toBe(baseline.totalBuffers);
    // After all of that, the same engine still loads the real model and reproduces the golden greedy ids.
    await expectGolden(engine, original, golden);
    log.record({
      area: 'loader',
      fault: 'the real stories260K after every fuzzed load, same engine and device',
      expected: 'golden greedy ids',
      outcome: 'golden ids reproduced',
      ok: true,
    });
  });

  it('replays the kept regression inputs (test/regressions/loader/*.json)', async () => {
    const original = new Uint8Array(readFileSync(modelPath!));
    const golden = JSON.parse(readFileSync(goldenPath!, 'utf8')) as { greedy_ids: number[] };
    const engine = new ModelRunner(ctx.gpu);
    const regressions = loaderRegressions();
    expect(regressions.length, `no inputs in ${LOADER_REGRESSIONS_DIR}`).toBeGreaterThan(0);
    for (const { file, mutation } of regressions) {
      let outcome: string;
      try {
        outcome = await loadMutated(engine, original, mutation);
      } catch (error) {
        log.record({
          area: 'loader',
          fault: `${file}: ${mutation.description}`,
          expected: 'LongtabError or load',
          outcome: String(error),
          ok: false,
        });
        throw error;
      }
      log.record({
        area: 'loader',
        fault: `regression ${file}: ${mutation.description}`,
        expected: 'loads, or throws a LongtabError; GPU buffers back to baseline',
        outcome,
        ok: true,
      });
    }
    await expectGolden(engine, original, golden);
  });
});
