import fc from 'fast-check';
import { describe, expect, it } from 'vitest';
import { CorruptModelFileError, LongtabError, UnsupportedModelError } from '../../core/errors.ts';
import { type ByteSource, GgmlType, GgufValueType } from '../../core/gguf-types.ts';
import { metadataForEveryValueType, randomBytes } from '../../test/gguf-fixtures.ts';
import { describeError, describeRefusal, faultLog, isRefusal, rejectionOf } from '../../test/regressions/fault-log.ts';
import { parseGguf } from './parse.ts';
import { sourceFromBytes } from './sources.ts';
import { writeGguf } from './writer.ts';

/*
 * Byte positions in the small files below. Header: magic @0, version @4, tensor count @8 (u64), metadata count @16
 * (u64). The first metadata key's length is @24, a one-letter key sits @32, its value type @33, its value @37.
 * With no metadata, the first tensor's name length is @24, a one-letter name @32, dim count @33, dim 0 @37,
 * type @45 and data offset @49.
 */
const FIRST_VALUE_TYPE = 33;
const FIRST_VALUE = 37;
const TENSOR_DIM_COUNT = 33;
const TENSOR_DIM0 = 37;
const TENSOR_TYPE = 45;
const TENSOR_OFFSET = 49;

function patched(bytes: Uint8Array, edit: (view: DataView) => void): Uint8Array {
  const copy = bytes.slice();
  edit(new DataView(copy.buffer));
  return copy;
}

function oneTensorFile(): Uint8Array {
  return writeGguf({
    metadata: [],
    tensors: [{ name: 'w', shape: [8], type: GgmlType.F32, data: randomBytes(32, 1) }],
  });
}

async function parseBytes(bytes: Uint8Array) {
  return parseGguf(sourceFromBytes(bytes, 'hostile.gguf'));
}

const log = faultLog('header');

/**
 * Parses `input` expecting a `type` whose message matches `message`; records the attempt for docs/faults.md before
 * asserting, so a failure shows as a row that is not ok. A countingSource also has its largest read checked.
 */
async function expectRefusal(
  fault: string,
  input: Uint8Array | (ByteSource & { largestRead?: number }),
  type: typeof CorruptModelFileError | typeof UnsupportedModelError,
  message?: RegExp | string,
): Promise<void> {
  const source = input instanceof Uint8Array ? sourceFromBytes(input, 'hostile.gguf') : input;
  const error = await rejectionOf(parseGguf(source));
  const largestRead = (source as { largestRead?: number }).largestRead;
  const bounded = largestRead === undefined || largestRead <= source.size;
  log.record({
    area: 'header',
    fault,
    expected: `${type.name}${message ? ' saying why' : ''}${largestRead === undefined ? '' : '; no read larger than the file'}`,
    outcome: `${describeRefusal(error, message)}${largestRead === undefined ? '' : `; largest read ${largestRead} of ${source.size} bytes`}`,
    ok: isRefusal(error, type, message) && bounded,
  });
  expect(error, fault).toBeInstanceOf(type);
  if (message !== undefined) expect((error as Error).message, fault).toMatch(message);
  expect(largestRead ?? 0, fault).toBeLessThanOrEqual(source.size);
}

type ParsedFile = Awaited<ReturnType<typeof parseBytes>>;

/** Records a file next to a refused one that a correct parser reads, then asserts it parsed as `check` wants. */
async function expectParsed(fault: string, bytes: Uint8Array, check: (file: ParsedFile) => boolean): Promise<void> {
  const parsed = await parseBytes(bytes).catch((error: unknown) => ({ error }));
  const error = 'error' in parsed ? parsed.error : null;
  const ok = error === null && check(parsed as ParsedFile);
  log.record({
    area: 'header',
    fault,
    expected: 'parses, its values intact',
    outcome: error !== null ? describeError(error) : ok ? 'parsed, values intact' : 'parsed, values differ',
    ok,
  });
  expect(ok, fault).toBe(true);
}

/** Records the largest single read, to prove no length field turned into a large allocation. */
function countingSource(bytes: Uint8Array): ByteSource & { largestRead: number } {
  const inner = sourceFromBytes(bytes, 'hostile.gguf');
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

/** A GGUF file with one u8 array of `items` items per key, written directly (writeGguf would build each array in JS). */
function u8ArraysFile(keys: string[], items: number): Uint8Array {
  const size = 24 + keys.reduce((sum, key) => sum + 8 + key.length + 4 + 4 + 8 + items, 0);
  const file = new Uint8Array(size);
  const view = new DataView(file.buffer);
  view.setUint32(0, 0x46554747, true);
  view.setUint32(4, 3, true);
  view.setBigUint64(8, 0n, true);
  view.setBigUint64(16, BigInt(keys.length), true);
  let at = 24;
  for (const key of keys) {
    view.setBigUint64(at, BigInt(key.length), true);
    file.set(new TextEncoder().encode(key), at + 8);
    at += 8 + key.length;
    view.setUint32(at, GgufValueType.ARRAY, true);
    view.setUint32(at + 4, GgufValueType.UINT8, true);
    view.setBigUint64(at + 8, BigInt(items), true);
    at += 16;
    file.fill(7, at, at + items);
    at += items;
  }
  return file;
}

/** Records the furthest byte any read reached, to prove the parser stopped before reading what it refused. */
function countingReadsSource(bytes: Uint8Array): ByteSource & { furthestByte: number } {
  const inner = sourceFromBytes(bytes, 'hostile.gguf');
  const source = {
    name: inner.name,
    size: inner.size,
    furthestByte: 0,
    read(offset: number, length: number) {
      source.furthestByte = Math.max(source.furthestByte, offset + length);
      return inner.read(offset, length);
    },
  };
  return source;
}

describe('parseGguf on hostile input', () => {
  it('rejects a file that is not GGUF', async () => {
    await expectRefusal(
      'a zip file',
      new TextEncoder().encode('PK\u0003\u0004 a zip file'),
      CorruptModelFileError,
      /not a GGUF file/,
    );
    await expectRefusal('an empty file', new Uint8Array(0), CorruptModelFileError);
    await expectRefusal('3 bytes: GGU', new TextEncoder().encode('GGU'), CorruptModelFileError, /not a GGUF file/);
  });

  it('rejects versions other than 2 and 3, naming big-endian files', async () => {
    const v3 = oneTensorFile();
    await expectParsed(
      'GGUF version 2',
      patched(v3, (v) => v.setUint32(4, 2, true)),
      (f) => f.version === 2,
    );
    await expectRefusal(
      'GGUF version 1',
      patched(v3, (v) => v.setUint32(4, 1, true)),
      UnsupportedModelError,
    );
    await expectRefusal(
      'GGUF version 4',
      patched(v3, (v) => v.setUint32(4, 4, true)),
      UnsupportedModelError,
      /version 4/,
    );
    await expectRefusal(
      'a big-endian GGUF file',
      patched(v3, (v) => v.setUint32(4, 3, false)),
      UnsupportedModelError,
      /big-endian/,
    );
  });

  it('rejects a string length larger than the file without allocating it', async () => {
    const file = writeGguf({ metadata: [{ key: 'a', value: 'hello' }] });
    for (const [label, length] of [
      ['2^40', 2n ** 40n],
      ['2^63', 2n ** 63n],
      ['2^64 - 1', 2n ** 64n - 1n],
      ['the file size', BigInt(file.length)],
    ] as const) {
      await expectRefusal(
        `a metadata string length of ${label}`,
        countingSource(patched(file, (v) => v.setBigUint64(FIRST_VALUE, length, true))),
        CorruptModelFileError,
      );
    }
    // The key's own length field, too.
    await expectRefusal(
      'a metadata key length of 2^50',
      patched(file, (v) => v.setBigUint64(24, 2n ** 50n, true)),
      CorruptModelFileError,
    );
  });

  it('rejects an array count larger than the file can hold', async () => {
    const file = writeGguf({ metadata: [{ key: 'a', type: 'u32[]', value: [1, 2, 3] }] });
    const countAt = FIRST_VALUE + 4;
    for (const [label, count] of [
      ['4 (one past the 3 stored)', 4n],
      ['2^31', 2n ** 31n],
      ['2^62', 2n ** 62n],
    ] as const) {
      await expectRefusal(
        `a u32 array count of ${label}`,
        countingSource(patched(file, (v) => v.setBigUint64(countAt, count, true))),
        CorruptModelFileError,
      );
    }
    const strings = writeGguf({ metadata: [{ key: 'a', value: ['x', 'y'] }] });
    await expectRefusal(
      'a string array count of 2^40',
      patched(strings, (v) => v.setBigUint64(countAt, 2n ** 40n, true)),
      CorruptModelFileError,
      /item count/,
    );
  });

  it('caps counts that fit the file but would cost far more memory parsed than stored', async () => {
    // A 17M-item u8 array: 17 MB on disk, but ~136 MB as a JS array.
    const items = 2 ** 24 + 1;
    const header = writeGguf({ metadata: [{ key: 'a', type: 'u8[]', value: [] }] });
    const file = new Uint8Array(header.length + items);
    file.set(header);
    new DataView(file.buffer).setBigUint64(FIRST_VALUE + 4, BigInt(items), true);
    await expectRefusal(
      'one u8 array of 2^24 + 1 items, all in the file (17 MB stored, ~136 MB as a JS array)',
      file,
      CorruptModelFileError,
      /implausibly many/,
    );
  });

  it('caps the items of all metadata arrays together, before allocating the one past the cap', async () => {
    // Three u8 arrays of 6M items: each under the cap of one array, 18M together (about 150 MB as JS arrays).
    const file = u8ArraysFile(['a', 'b', 'c'], 6_000_000);
    const source = countingReadsSource(file);
    const error = await rejectionOf(parseGguf(source));
    const message =
      /metadata arrays hold more than 16777216 items in all \(at "c", 6000000 items\), far more than any real model's/;
    // Refused at the third array's count: none of its items was read.
    const unread = source.furthestByte < file.byteLength - 6_000_000 + 1024 * 1024;
    log.record({
      area: 'header',
      fault: 'three u8 arrays of 6M items each, all in the file: each under the one-array cap, 18M together',
      expected: "CorruptModelFileError at the third array's count, before its items are read",
      outcome: `${describeRefusal(error, message)}; read ${source.furthestByte} of ${file.byteLength} bytes`,
      ok: isRefusal(error, CorruptModelFileError, message) && unread,
    });
    expect(error).toBeInstanceOf(CorruptModelFileError);
    expect((error as Error).message).toMatch(message);
    expect(unread).toBe(true);
    // Small arrays parse, their items intact.
    await expectParsed('three u8 arrays of 1000 items', u8ArraysFile(['a', 'b', 'c'], 1000), (parsed) => {
      const items = parsed.metadata.c as number[];
      return items.length === 1000 && items.every((item) => item === 7);
    });
  });

  it('caps the memory the parsed header may take (maxHeapBytes), before allocating what would pass it', async () => {
    const strings = Array.from({ length: 1000 }, (_, i) => `${i}`.padEnd(1000, 'x'));
    const file = writeGguf({ metadata: [{ key: 'tokens', value: strings }] });
    const error = await rejectionOf(parseGguf(sourceFromBytes(file, 'hostile.gguf'), { maxHeapBytes: 1 << 20 }));
    const message = /its header would take more than 1 MiB of memory once parsed/;
    log.record({
      area: 'header',
      fault: 'a header of 1000 strings of 1000 characters, parsed with maxHeapBytes 1 MiB',
      expected: 'CorruptModelFileError naming the memory cap',
      outcome: describeRefusal(error, message),
      ok: isRefusal(error, CorruptModelFileError, message),
    });
    expect(error).toBeInstanceOf(CorruptModelFileError);
    expect((error as Error).message).toMatch(message);
    // The default budget holds it (a real vocabulary takes tens of MiB).
    await expectParsed('the same header under the default maxHeapBytes (512 MiB)', file, (parsed) => {
      const tokens = parsed.metadata.tokens as string[];
      return tokens.length === strings.length && tokens.every((token, i) => token === strings[i]);
    });
  });

  it('rejects huge tensor and metadata counts', async () => {
    const file = oneTensorFile();
    await expectRefusal(
      'a tensor count of 2^40',
      patched(file, (v) => v.setBigUint64(8, 2n ** 40n, true)),
      CorruptModelFileError,
      /tensor count/,
    );
    await expectRefusal(
      'a metadata count of 2^63',
      patched(file, (v) => v.setBigUint64(16, 2n ** 63n, true)),
      CorruptModelFileError,
      /metadata count/,
    );
    await expectRefusal(
      'a tensor count of 3 with 1 tensor stored',
      patched(file, (v) => v.setBigUint64(8, 3n, true)),
      CorruptModelFileError,
    );
  });

  it('rejects tensor data that lies outside the file, naming the tensor', async () => {
    const file = oneTensorFile();
    await expectRefusal(
      "a file cut 1 byte before its tensor's end",
      file.subarray(0, file.length - 1),
      CorruptModelFileError,
      /Tensor w .*truncated/,
    );
    await expectRefusal(
      'a tensor data offset of 2^40',
      patched(file, (v) => v.setBigUint64(TENSOR_OFFSET, 2n ** 40n, true)),
      CorruptModelFileError,
      /Tensor w/,
    );
    await expectRefusal(
      'a tensor dimension of 2^20 (data past the end)',
      patched(file, (v) => v.setBigUint64(TENSOR_DIM0, 2n ** 20n, true)),
      CorruptModelFileError,
      /Tensor w/,
    );
  });

  it('rejects malformed tensor infos', async () => {
    const file = oneTensorFile();
    const cases: [string, (v: DataView) => void, RegExp][] = [
      ['zero dimension', (v) => v.setBigUint64(TENSOR_DIM0, 0n, true), /dimension 0 = 0/],
      ['huge dimension', (v) => v.setBigUint64(TENSOR_DIM0, 2n ** 63n, true), /dimension 0/],
      ['no dimensions', (v) => v.setUint32(TENSOR_DIM_COUNT, 0, true), /0 dimensions/],
      ['too many dimensions', (v) => v.setUint32(TENSOR_DIM_COUNT, 1000, true), /1000 dimensions/],
      ['misaligned offset', (v) => v.setBigUint64(TENSOR_OFFSET, 4n, true), /alignment/],
      ['partial block', (v) => v.setUint32(TENSOR_TYPE, GgmlType.Q8_0, true), /block size/],
    ];
    for (const [label, edit, message] of cases) {
      await expectRefusal(`tensor info: ${label}`, patched(file, edit), CorruptModelFileError, message);
    }
  });

  it('rejects an unknown tensor type as unsupported, naming the tensor and type id', async () => {
    const file = oneTensorFile();
    for (const typeId of [4, 5, 31, 999]) {
      await expectRefusal(
        `tensor type id ${typeId} (not a ggml type this runtime knows)`,
        patched(file, (v) => v.setUint32(TENSOR_TYPE, typeId, true)),
        UnsupportedModelError,
        new RegExp(`Tensor w .*type id ${typeId}`),
      );
    }
  });

  it('rejects an undefined metadata value type id, also inside arrays', async () => {
    const file = writeGguf({ metadata: [{ key: 'a', type: 'u32', value: 7 }] });
    await expectRefusal(
      'metadata value type id 13',
      patched(file, (v) => v.setUint32(FIRST_VALUE_TYPE, 13, true)),
      CorruptModelFileError,
      /value type id 13/,
    );
    const array = writeGguf({ metadata: [{ key: 'a', type: 'u32[]', value: [7] }] });
    for (const [itemTypeId, count] of [
      [99, 1n],
      [99, 0n],
    ] as const) {
      const bad = patched(array, (v) => {
        v.setUint32(FIRST_VALUE, itemTypeId, true);
        v.setBigUint64(FIRST_VALUE + 4, count, true);
      });
      await expectRefusal(`array item type id ${itemTypeId}, ${count} items`, bad, CorruptModelFileError);
    }
  });

  it('rejects duplicate metadata keys and tensor names', async () => {
    const keys = writeGguf({
      metadata: [
        { key: 'a', value: 'x' },
        { key: 'b', value: 'y' },
      ],
    });
    // Second key 'b' follows the first entry: 8 + 1 (key) + 4 (type) + 8 + 1 (value) after @24, then its length.
    const secondKey = 24 + 8 + 1 + 4 + 8 + 1 + 8;
    expect(String.fromCharCode(keys[secondKey])).toBe('b');
    await expectRefusal(
      'a metadata key that appears twice',
      patched(keys, (v) => v.setUint8(secondKey, 'a'.charCodeAt(0))),
      CorruptModelFileError,
      /"a" appears twice/,
    );

    const tensors = writeGguf({
      metadata: [],
      tensors: [
        { name: 'p', shape: [1], type: GgmlType.F32, data: new Uint8Array(4) },
        { name: 'q', shape: [1], type: GgmlType.F32, data: new Uint8Array(4) },
      ],
    });
    const secondName = 24 + 8 + 1 + 4 + 8 + 4 + 8 + 8;
    expect(String.fromCharCode(tensors[secondName])).toBe('q');
    await expectRefusal(
      'a tensor name that appears twice',
      patched(tensors, (v) => v.setUint8(secondName, 'p'.charCodeAt(0))),
      CorruptModelFileError,
      /"p" appears twice/,
    );
  });

  it('rejects a bad general.alignment and a non-0/1 bool', async () => {
    // The writer refuses these, so write a look-alike key and patch its last letter.
    for (const [type, value] of [
      ['u32', 48],
      ['u32', 0],
      ['i32', 64],
    ] as const) {
      const file = writeGguf({ metadata: [{ key: 'general.alignmenT', type, value }] });
      const bad = patched(file, (v) => v.setUint8(24 + 8 + 16, 't'.charCodeAt(0)));
      await expectRefusal(`general.alignment ${value} (${type})`, bad, CorruptModelFileError, /general.alignment is/);
    }
    const bool = writeGguf({ metadata: [{ key: 'a', value: true }] });
    await expectRefusal(
      'a bool stored as 2',
      patched(bool, (v) => v.setUint8(FIRST_VALUE, 2)),
      CorruptModelFileError,
      /bool/,
    );
  });

  it('rejects arrays nested deeper than any real file, without exhausting the stack', async () => {
    // 10 000 nested one-element arrays: each level is item type ARRAY + count 1.
    const depth = 10_000;
    const prefix = writeGguf({ metadata: [{ key: 'a', type: { array: 'u8[]' }, value: [] }] }).subarray(0, FIRST_VALUE);
    const body = new Uint8Array(depth * 12 + 4 + 8);
    const view = new DataView(body.buffer);
    for (let level = 0; level < depth; level++) {
      view.setUint32(level * 12, GgufValueType.ARRAY, true);
      view.setBigUint64(level * 12 + 4, 1n, true);
    }
    view.setUint32(depth * 12, GgufValueType.UINT8, true);
    const file = new Uint8Array(prefix.length + body.length);
    file.set(prefix);
    file.set(body, prefix.length);
    await expectRefusal('metadata arrays nested 10 000 deep', file, CorruptModelFileError, /nests arrays/);
  });

  it('reports every truncation of a written file as a corrupt file', async () => {
    const file = writeGguf({
      metadata: metadataForEveryValueType(),
      tensors: [
        { name: 'a', shape: [3], type: GgmlType.F32, data: randomBytes(12, 2) },
        { name: 'b', shape: [32], type: GgmlType.Q8_0, data: randomBytes(34, 3) },
      ],
    });
    const parsed = await parseBytes(file);
    const dataEnd = Math.max(...parsed.tensors.map((t) => t.offset + t.byteLength));
    const wrong: string[] = [];
    for (let length = 0; length < file.length; length++) {
      const error = await rejectionOf(parseBytes(file.subarray(0, length)));
      // Past the data only the last tensor's alignment padding is missing: the data is all there, and it parses.
      const ok = length < dataEnd ? error instanceof CorruptModelFileError : error === null;
      if (!ok) wrong.push(`${length} bytes: ${describeError(error)}`);
    }
    log.record({
      area: 'header',
      fault: `every truncation of a ${file.length}-byte file holding every metadata value type and 2 tensors`,
      expected: 'CorruptModelFileError while tensor data is missing; parses once only padding is missing',
      outcome: wrong.length === 0 ? `as expected for all ${file.length} lengths` : wrong.slice(0, 3).join('; '),
      ok: wrong.length === 0,
      count: file.length,
    });
    expect(wrong).toEqual([]);
  });

  it('answers random damage with a parse or a typed error, never anything else (fast-check)', async () => {
    const file = writeGguf({
      metadata: metadataForEveryValueType(),
      tensors: [
        { name: 'a', shape: [4, 2], type: GgmlType.F32, data: randomBytes(32, 4) },
        { name: 'b', shape: [256], type: GgmlType.Q4_K, data: randomBytes(144, 5) },
      ],
    });
    const damage = fc.record({
      cut: fc.integer({ min: 0, max: file.length }),
      flips: fc.array(fc.record({ at: fc.nat({ max: file.length - 1 }), bit: fc.integer({ min: 0, max: 7 }) }), {
        maxLength: 8,
      }),
      overwrites: fc.array(
        fc.record({ at: fc.nat({ max: file.length - 8 }), value: fc.bigUint64Array({ maxLength: 1, minLength: 1 }) }),
        {
          maxLength: 2,
        },
      ),
    });
    const runs = 300;
    const seed = 20261129;
    const outcomes = new Map<string, number>();
    let failure: unknown = null;
    try {
      await fc.assert(
        fc.asyncProperty(damage, async ({ cut, flips, overwrites }) => {
          const bytes = file.slice();
          const view = new DataView(bytes.buffer);
          for (const { at, bit } of flips) bytes[at] ^= 1 << bit;
          for (const { at, value } of overwrites) view.setBigUint64(at, value[0], true);
          const error = await rejectionOf(parseBytes(bytes.subarray(0, cut)));
          const outcome = error === null ? 'parsed' : describeError(error);
          outcomes.set(outcome, (outcomes.get(outcome) ?? 0) + 1);
          if (error === null) return;
          if (!(error instanceof LongtabError)) throw error;
          expect(['corrupt-model-file', 'unsupported-model']).toContain(error.code);
        }),
        { numRuns: runs, seed },
      );
    } catch (error) {
      failure = error;
    }
    log.record({
      area: 'header',
      fault: `random damage (cut, up to 8 bit flips, up to 2 u64 overwrites) of a file holding every value type (fast-check, seed ${seed})`,
      expected: 'parses, or CorruptModelFileError / UnsupportedModelError; nothing else thrown',
      outcome:
        [...outcomes]
          .sort((a, b) => b[1] - a[1])
          .map(([outcome, n]) => `${outcome} ×${n}`)
          .join('; ') + (failure ? `; FAILED: ${(failure as Error).message.split('\n')[0]}` : ''),
      ok: failure === null,
      count: runs,
    });
    if (failure) throw failure;
  });
});
