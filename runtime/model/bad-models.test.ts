import { readFileSync } from 'node:fs';
import { describe, expect, it } from 'vitest';
import { CorruptModelFileError, UnsupportedModelError } from '../../core/errors.ts';
import { GgmlType, type GgufFile } from '../../core/gguf-types.ts';
import { withTestGpu } from '../../test/gpu.ts';
import { describeRefusal, faultLog, isRefusal, rejectionOf } from '../../test/regressions/fault-log.ts';
import { STORIES260K, STORIES260K_GOLDEN, sharedPath } from '../../test/shared.ts';
import { ModelRunner } from '../engine/model-runner.ts';
import { parseGguf } from '../gguf/parse.ts';
import { sourceFromBytes } from '../gguf/sources.ts';
import { type GgufMetadataEntry, metadataEntriesOf, writeGguf } from '../gguf/writer.ts';

const ctx = withTestGpu();
const modelPath = sharedPath(STORIES260K);
const goldenPath = sharedPath(STORIES260K_GOLDEN);
const log = faultLog('bad-models');

/** stories260K rewritten through the project's GGUF writer with one deliberate defect. */
function variant(
  bytes: Uint8Array,
  file: GgufFile,
  change: { metadata?: (entries: GgufMetadataEntry[]) => GgufMetadataEntry[]; tensorType?: [string, GgmlType] },
): Uint8Array {
  const metadata = (change.metadata ?? ((e) => e))(metadataEntriesOf(file));
  const tensors = file.tensors.map((t) => {
    const data = bytes.subarray(t.offset, t.offset + t.byteLength);
    if (change.tensorType && t.name === change.tensorType[0]) {
      // Q8_1: a type the parser knows and the runtime does not run as a weight (36 bytes per 32 values).
      const count = t.shape.reduce((a, b) => a * b, 1);
      return { name: t.name, shape: t.shape, type: change.tensorType[1], data: new Uint8Array((count / 32) * 36) };
    }
    return { name: t.name, shape: t.shape, type: t.type, data };
  });
  return writeGguf({ metadata, tensors, alignment: file.alignment });
}

describe.skipIf(!modelPath || !goldenPath)(
  'bad model files: typed errors, nothing left on the GPU, the engine still works',
  () => {
    it('rejects each defect with an error that names it, then loads the real model and reproduces the golden ids', async () => {
      const { gpu } = ctx;
      const bytes = new Uint8Array(readFileSync(modelPath!));
      const file = await parseGguf(sourceFromBytes(bytes));
      const setValue = (key: string, value: number | string) => (entries: GgufMetadataEntry[]) =>
        entries.map((e) => (e.key === key ? { ...e, value } : e));
      const addValue = (key: string, value: number, type: 'f32' | 'u32') => (entries: GgufMetadataEntry[]) => [
        ...entries.filter((e) => e.key !== key),
        { key, value, type },
      ];
      // A per-layer array, as llama.cpp also reads some hyperparameters.
      const setArray = (key: string, values: number[]) => (entries: GgufMetadataEntry[]) =>
        entries.map((e) => (e.key === key ? { key, value: values, type: 'u32[]' as const } : e));
      /** The vocabulary arrays (tokens, scores, types) cut or grown to `count(n)` entries. */
      const withTokens = (count: (n: number) => number) => (entries: GgufMetadataEntry[]) =>
        entries.map((e) => {
          if (!e.key.startsWith('tokenizer.ggml.') || !Array.isArray(e.value)) return e;
          const values = e.value as (string | number)[];
          const n = count(values.length);
          const grown = values.slice(0, n);
          while (grown.length < n) grown.push(typeof values[0] === 'string' ? `<extra_${grown.length}>` : 0);
          return { ...e, value: grown };
        });
      const cases: Array<{ name: string; bytes: Uint8Array; error: new (...args: never[]) => Error; message: RegExp }> =
        [
          {
            name: 'not a GGUF file',
            bytes: new TextEncoder().encode('<html>404 Not Found</html>'.repeat(4)),
            error: CorruptModelFileError,
            message: /not a GGUF/i,
          },
          {
            name: 'truncated inside tensor data',
            bytes: bytes.subarray(0, bytes.length - 5000),
            error: CorruptModelFileError,
            message: /output|tensor|truncat|bounds|end of/i,
          },
          {
            name: 'unknown architecture',
            bytes: variant(bytes, file, { metadata: setValue('general.architecture', 'gpt-neox') }),
            error: UnsupportedModelError,
            message: /gpt-neox/,
          },
          {
            name: 'unsupported tensor type',
            bytes: variant(bytes, file, { tensorType: ['blk.0.attn_q.weight', GgmlType.Q8_1] }),
            error: UnsupportedModelError,
            message: /attn_q.*Q8_1/,
          },
          {
            name: 'metadata contradicts tensor shapes',
            bytes: variant(bytes, file, { metadata: setValue('llama.embedding_length', 96) }),
            error: CorruptModelFileError,
            message: /contradicts|shape/,
          },
          // Values the forward pass divides by or pairs up, named by key before any buffer is made.
          {
            name: 'RMS epsilon NaN',
            bytes: variant(bytes, file, { metadata: setValue('llama.attention.layer_norm_rms_epsilon', Number.NaN) }),
            error: CorruptModelFileError,
            message: /layer_norm_rms_epsilon is NaN/,
          },
          {
            name: 'RoPE base 0',
            bytes: variant(bytes, file, { metadata: addValue('llama.rope.freq_base', 0, 'f32') }),
            error: CorruptModelFileError,
            message: /rope\.freq_base is 0/,
          },
          {
            name: 'odd RoPE dimension',
            bytes: variant(bytes, file, { metadata: setValue('llama.rope.dimension_count', 7) }),
            error: CorruptModelFileError,
            message: /rope\.dimension_count is 7.*even/,
          },
          {
            name: 'KV heads that do not divide the heads',
            bytes: variant(bytes, file, { metadata: setValue('llama.attention.head_count_kv', 3) }),
            error: CorruptModelFileError,
            message: /head_count_kv is 3.*divide the 8/,
          },
          {
            name: 'KV heads per layer, not all the same',
            bytes: variant(bytes, file, { metadata: setArray('llama.attention.head_count_kv', [4, 4, 2, 4, 4]) }),
            error: UnsupportedModelError,
            message: /head_count_kv per layer \(4, 4, 2, 4, 4\)/,
          },
          // The tokenizer and the embedding must agree on the vocabulary: one row per token.
          {
            name: 'a token more than the embedding has rows',
            bytes: variant(bytes, file, { metadata: withTokens((n) => n + 1) }),
            error: CorruptModelFileError,
            message: /tokenizer has 513 tokens .* token embedding has 512 rows/,
          },
          {
            name: 'a token fewer than the embedding has rows',
            bytes: variant(bytes, file, { metadata: withTokens((n) => n - 1) }),
            error: CorruptModelFileError,
            message: /tokenizer has 511 tokens .* token embedding has 512 rows/,
          },
        ];
      const engine = new ModelRunner(gpu);
      const baseline = gpu.allocator.snapshot();
      for (const c of cases) {
        const error = await rejectionOf(engine.load(sourceFromBytes(c.bytes, c.name), { kv: 'f16' }));
        const after = gpu.allocator.snapshot();
        const buffersLeft = after.totalBuffers - baseline.totalBuffers;
        const bytesLeft = after.totalBytes - baseline.totalBytes;
        log.record({
          area: 'model',
          fault: `stories260K: ${c.name}`,
          expected: `${c.error.name} saying why; 0 GPU buffers, 0 bytes left`,
          outcome: `${describeRefusal(error, c.message)}; ${buffersLeft} buffers, ${bytesLeft} bytes left`,
          ok: isRefusal(error, c.error, c.message) && buffersLeft === 0 && bytesLeft === 0,
        });
        expect(error, c.name).toBeInstanceOf(c.error);
        expect((error as Error).message, c.name).toMatch(c.message);
        expect(buffersLeft, `${c.name}: GPU buffers left behind`).toBe(0);
        expect(bytesLeft, `${c.name}: GPU bytes left behind`).toBe(0);
      }
      const golden = JSON.parse(readFileSync(goldenPath!, 'utf8')) as { greedy_ids: number[] };
      // The real model, and the same with its KV head count written per layer (all alike): both give the golden ids.
      for (const [name, model] of [
        ['the real stories260K, after every refusal, same runner and device', bytes],
        [
          'stories260K with its KV head count written per layer, all alike',
          variant(bytes, file, { metadata: setArray('llama.attention.head_count_kv', [4, 4, 4, 4, 4]) }),
        ],
      ] as const) {
        await engine.load(sourceFromBytes(model), { kv: 'f16' });
        const result = await engine.generate({ promptIds: [golden.greedy_ids[0]], maxTokens: 20, stopAtEog: false });
        const golden20 = golden.greedy_ids.slice(1, 21);
        const same = result.ids.length === golden20.length && result.ids.every((id, i) => id === golden20[i]);
        log.record({
          area: 'model',
          fault: name,
          expected: 'loads; golden greedy ids',
          outcome: same ? 'golden ids reproduced' : `ids differ: ${result.ids.slice(0, 8).join(',')}…`,
          ok: same,
        });
        expect(result.ids).toEqual(golden20);
      }
      engine.unload();
      expect(gpu.allocator.snapshot().totalBuffers).toBe(baseline.totalBuffers);
    });
  },
);
