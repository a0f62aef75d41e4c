/** Test-only GGUF inputs shared by the gguf tests (never imported by runtime code). */

import type { GgufMetadataEntry } from '../runtime/gguf/writer.ts';
import { seededRandom } from './random.ts';

export function randomBytes(length: number, seed: number): Uint8Array {
  const random = seededRandom(seed);
  const bytes = new Uint8Array(length);
  for (let i = 0; i < length; i++) bytes[i] = Math.floor(random() * 256);
  return bytes;
}

/** Every GGUF value type at its edges, with the types spelled as parseGguf reports them. */
export function metadataForEveryValueType(): Required<GgufMetadataEntry>[] {
  return [
    { key: 'general.architecture', type: 'string', value: 'llama' },
    { key: 'test.u8', type: 'u8', value: 255 },
    { key: 'test.i8', type: 'i8', value: -128 },
    { key: 'test.u16', type: 'u16', value: 65535 },
    { key: 'test.i16', type: 'i16', value: -32768 },
    { key: 'test.u32', type: 'u32', value: 4294967295 },
    { key: 'test.i32', type: 'i32', value: -2147483648 },
    { key: 'test.f32', type: 'f32', value: Math.fround(0.1) },
    { key: 'test.f64', type: 'f64', value: 0.1 },
    { key: 'test.bool.true', type: 'bool', value: true },
    { key: 'test.bool.false', type: 'bool', value: false },
    { key: 'test.string.unicode', type: 'string', value: 'héllo ▁世界 🦙\n\u0000' },
    { key: 'test.string.empty', type: 'string', value: '' },
    { key: 'test.u64.small', type: 'u64', value: 12345 },
    { key: 'test.u64.max', type: 'u64', value: 2n ** 64n - 1n },
    { key: 'test.i64.min', type: 'i64', value: -(2n ** 63n) },
    { key: 'test.i64.negative', type: 'i64', value: -5 },
    { key: 'test.u8s', type: 'u8[]', value: [0, 1, 255] },
    { key: 'test.i8s', type: 'i8[]', value: [-1, 127] },
    { key: 'test.u16s', type: 'u16[]', value: [7] },
    { key: 'test.i16s', type: 'i16[]', value: [-7, 300] },
    { key: 'test.u32s', type: 'u32[]', value: [1, 2, 3] },
    { key: 'tokenizer.ggml.token_type', type: 'i32[]', value: [2, 3, 3, 6, 1, -1] },
    { key: 'tokenizer.ggml.scores', type: 'f32[]', value: [0, -1.5, Math.fround(-3.3), Math.fround(1e30)] },
    { key: 'test.f64s', type: 'f64[]', value: [Math.PI, -0] },
    { key: 'test.bools', type: 'bool[]', value: [true, false, true] },
    { key: 'test.u64s', type: 'u64[]', value: [0, 2n ** 63n] },
    { key: 'test.i64s', type: 'i64[]', value: [-1, 2n ** 62n] },
    { key: 'tokenizer.ggml.tokens', type: 'string[]', value: ['<unk>', '', '▁the', '<0x0A>'] },
    { key: 'tokenizer.ggml.merges', type: 'string[]', value: ['▁ t', 'h e'] },
    { key: 'test.empty.i32s', type: 'i32[]', value: [] },
    { key: 'test.empty.strings', type: 'string[]', value: [] },
    { key: 'test.nested.i32s', type: { array: 'i32[]' }, value: [[1, 2], [3]] },
    { key: 'test.nested.strings', type: { array: 'string[]' }, value: [['a'], ['b', 'c']] },
    { key: 'test.nested.empty', type: { array: 'f32[]' }, value: [[]] },
    { key: 'test.nested.none', type: { array: 'u8[]' }, value: [] },
    { key: 'test.nested.deep', type: { array: { array: 'u16[]' } }, value: [[[1], [2, 3]], []] },
  ];
}
