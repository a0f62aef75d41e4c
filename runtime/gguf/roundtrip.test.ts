import { mkdtemp, rm, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { describe, expect, it } from 'vitest';
import { AbortedError, CorruptModelFileError, DownloadFailedError, InvalidRequestError } from '../../core/errors.ts';
import { GGML_TYPE_INFO, GgmlType, type GgufMetadataType } from '../../core/gguf-types.ts';
import { metadataForEveryValueType, randomBytes } from '../../test/gguf-fixtures.ts';
import { describeRefusal, faultLog, isRefusal, rejectionOf } from '../../test/regressions/fault-log.ts';
import { sourceFromPath } from './node-source.ts';
import { parseGguf } from './parse.ts';
import { streamTensorBytes } from './read-tensor.ts';
import { sourceFromBlob, sourceFromBytes, sourceFromUrl } from './sources.ts';
import { type GgufTensorInput, metadataEntriesOf, planGguf, writeGguf } from './writer.ts';

/** One tensor per layout family: plain floats, 16-bit, 32-element blocks, 256-element super-blocks, integers. */
function tensorsOfSeveralTypes(): GgufTensorInput[] {
  const make = (name: string, shape: number[], type: GgmlType, seed: number): GgufTensorInput => {
    const info = GGML_TYPE_INFO[type]!;
    const elements = shape.reduce((a, b) => a * b, 1);
    return { name, shape, type, data: randomBytes((elements / info.blockSize) * info.blockBytes, seed) };
  };
  return [
    make('f32.weight', [7, 3], GgmlType.F32, 1),
    make('f16.weight', [5], GgmlType.F16, 2),
    make('q8_0.weight', [64, 3], GgmlType.Q8_0, 3),
    make('q4_0.weight', [32, 2, 2], GgmlType.Q4_0, 4),
    make('q4_k.weight', [256, 2], GgmlType.Q4_K, 5),
    make('q6_k.weight', [512], GgmlType.Q6_K, 6),
    make('bf16.weight', [3, 1, 1, 2], GgmlType.BF16, 7),
    make('i32.positions', [9], GgmlType.I32, 8),
  ];
}

const log = faultLog('file-paths');

describe('writeGguf → parseGguf round trip', () => {
  it('keeps every metadata value type, including 64-bit extremes and nested arrays', async () => {
    const entries = metadataForEveryValueType();
    const file = await parseGguf(sourceFromBytes(writeGguf({ metadata: entries })));
    expect(file.version).toBe(3);
    expect(file.tensors).toEqual([]);
    expect(Object.keys(file.metadata)).toEqual(entries.map((entry) => entry.key));
    for (const entry of entries) {
      expect(file.metadata[entry.key], entry.key).toEqual(entry.value);
      expect(file.metadataTypes![entry.key], entry.key).toEqual(entry.type);
    }
    // 64-bit values come back as numbers when exact, bigints otherwise.
    expect(typeof file.metadata['test.u64.small']).toBe('number');
    expect(file.metadata['test.u64.max']).toBe(2n ** 64n - 1n);
    expect(file.metadata['test.i64.min']).toBe(-(2n ** 63n));
  });

  it('writes headers far larger than its initial buffer (a 20 000-token vocabulary)', async () => {
    const tokens = Array.from({ length: 20_000 }, (_, i) => `▁token${i}`);
    const scores = tokens.map((_, i) => -i);
    const bytes = writeGguf({
      metadata: [
        { key: 'tokenizer.ggml.tokens', type: 'string[]', value: tokens },
        { key: 'tokenizer.ggml.scores', type: 'f32[]', value: scores },
        { key: 'after.vocabulary', type: 'u64', value: 2n ** 60n },
      ],
    });
    const file = await parseGguf(sourceFromBytes(bytes), { windowBytes: 4096 });
    expect(file.metadata['tokenizer.ggml.tokens']).toEqual(tokens);
    expect(file.metadata['tokenizer.ggml.scores']).toEqual(scores);
    expect(file.metadata['after.vocabulary']).toBe(2n ** 60n);
  });

  it('infers string, bool and string-array types, and accepts a typed record', async () => {
    const bytes = writeGguf({
      metadata: {
        'general.architecture': 'llama',
        'general.flag': true,
        'tokenizer.ggml.tokens': ['<unk>', 'a'],
        'llama.context_length': { type: 'u32', value: 128 },
        'llama.rope.freq_base': { type: 'f32', value: 10000 },
      },
    });
    const file = await parseGguf(sourceFromBytes(bytes));
    expect(file.metadataTypes).toEqual({
      'general.architecture': 'string',
      'general.flag': 'bool',
      'tokenizer.ggml.tokens': 'string[]',
      'llama.context_length': 'u32',
      'llama.rope.freq_base': 'f32',
    });
    expect(file.metadata['llama.rope.freq_base']).toBe(10000);
  });

  it('places tensors of several types at aligned offsets with their exact bytes', async () => {
    const tensors = tensorsOfSeveralTypes();
    for (const alignment of [32, 64, 4096]) {
      const bytes = writeGguf({ metadata: [{ key: 'general.architecture', value: 'test' }], tensors, alignment });
      const file = await parseGguf(sourceFromBytes(bytes));
      expect(file.alignment).toBe(alignment);
      expect(file.metadata['general.alignment']).toBe(alignment === 32 ? undefined : alignment);
      expect(file.dataOffset % alignment).toBe(0);
      expect(file.fileSize).toBe(bytes.byteLength);
      expect(file.tensors.map((t) => [t.name, t.shape, t.type])).toEqual(tensors.map((t) => [t.name, t.shape, t.type]));
      file.tensors.forEach((info, i) => {
        expect(info.offset % alignment).toBe(0);
        expect(info.byteLength).toBe(tensors[i].data.byteLength);
        expect(bytes.subarray(info.offset, info.offset + info.byteLength)).toEqual(tensors[i].data);
      });
    }
  });

  it('parses identically through tiny header windows (refills, strings longer than the window)', async () => {
    const bytes = writeGguf({ metadata: metadataForEveryValueType(), tensors: tensorsOfSeveralTypes() });
    const reference = await parseGguf(sourceFromBytes(bytes));
    for (const windowBytes of [1, 3, 8, 17, 100]) {
      expect(await parseGguf(sourceFromBytes(bytes), { windowBytes })).toEqual(reference);
    }
  });

  it('copies a parsed file’s metadata with its original types', async () => {
    const original = writeGguf({ metadata: metadataForEveryValueType(), tensors: tensorsOfSeveralTypes() });
    const parsed = await parseGguf(sourceFromBytes(original));
    const rewritten = writeGguf({
      metadata: metadataEntriesOf(parsed),
      tensors: parsed.tensors.map((t) => ({ ...t, data: original.subarray(t.offset, t.offset + t.byteLength) })),
    });
    expect(rewritten).toEqual(original);
  });
});

describe('planGguf (streaming writes)', () => {
  it('lays out the same bytes writeGguf produces, without holding tensor data', () => {
    const tensors = tensorsOfSeveralTypes();
    const metadata = metadataForEveryValueType();
    for (const alignment of [32, 256]) {
      const whole = writeGguf({ metadata, tensors, alignment });
      const layout = planGguf({ metadata, tensors: tensors.map(({ data: _, ...info }) => info), alignment });
      expect(layout.fileSize).toBe(whole.byteLength);
      const assembled = new Uint8Array(layout.fileSize);
      assembled.set(layout.header);
      tensors.forEach((tensor, i) => {
        expect(layout.tensorByteLengths[i]).toBe(tensor.data.byteLength);
        assembled.set(tensor.data, layout.tensorOffsets[i]);
      });
      expect(assembled).toEqual(whole);
    }
  });
});

describe('writeGguf input validation', () => {
  const f32 = (shape: number[], bytes: number): GgufTensorInput => ({
    name: 'w',
    shape,
    type: GgmlType.F32,
    data: new Uint8Array(bytes),
  });
  it.each([
    ['data shorter than the shape needs', { metadata: [], tensors: [f32([4, 2], 28)] }],
    ['data longer than the shape needs', { metadata: [], tensors: [f32([4], 20)] }],
    ['a zero dimension', { metadata: [], tensors: [f32([4, 0], 0)] }],
    ['five dimensions', { metadata: [], tensors: [f32([1, 1, 1, 1, 1], 4)] }],
    [
      'a row that is not whole Q4_0 blocks',
      { metadata: [], tensors: [{ name: 'q', shape: [16], type: GgmlType.Q4_0, data: new Uint8Array(9) }] },
    ],
    ['a duplicate tensor name', { metadata: [], tensors: [f32([1], 4), f32([1], 4)] }],
    ['a tensor name ggml cannot hold', { metadata: [], tensors: [{ ...f32([1], 4), name: 'x'.repeat(64) }] }],
    ['a number without a type', { metadata: [{ key: 'n', value: 3 }] }],
    ['an empty array without a type', { metadata: [{ key: 'a', value: [] }] }],
    ['a u32 out of range', { metadata: [{ key: 'n', value: -1, type: 'u32' as GgufMetadataType }] }],
    ['a fractional i32', { metadata: [{ key: 'n', value: 1.5, type: 'i32' as GgufMetadataType }] }],
    ['a u64 too large', { metadata: [{ key: 'n', value: 2n ** 64n, type: 'u64' as GgufMetadataType }] }],
    ['a string typed as f32', { metadata: [{ key: 'n', value: 'x', type: 'f32' as GgufMetadataType }] }],
    ['a mixed array', { metadata: [{ key: 'a', value: ['x', 1], type: 'string[]' as GgufMetadataType }] }],
    [
      'a duplicate key',
      {
        metadata: [
          { key: 'k', value: 'a' },
          { key: 'k', value: 'b' },
        ],
      },
    ],
    ['an alignment that is not a power of two', { metadata: [], alignment: 48 }],
  ])('rejects %s with InvalidRequestError', (_, input) => {
    expect(() => writeGguf(input as Parameters<typeof writeGguf>[0])).toThrow(InvalidRequestError);
  });
});

describe('streamTensorBytes', () => {
  it('delivers the tensor in order, in chunks of whole blocks and 4-byte words, no larger than asked', async () => {
    const data = randomBytes(18 * 37, 11);
    const bytes = writeGguf({ metadata: [], tensors: [{ name: 'q', shape: [32 * 37], type: GgmlType.Q4_0, data }] });
    const reads: number[] = [];
    const source = sourceFromBytes(bytes);
    const counting = {
      ...source,
      read: (offset: number, length: number) => {
        reads.push(length);
        return source.read(offset, length);
      },
    };
    const [tensor] = (await parseGguf(source)).tensors;
    const received = new Uint8Array(tensor.byteLength);
    const offsets: number[] = [];
    await streamTensorBytes(counting, tensor, 100, async (chunk, offsetInTensor) => {
      offsets.push(offsetInTensor);
      received.set(chunk, offsetInTensor);
    });
    expect(received).toEqual(data);
    expect(Math.max(...reads)).toBeLessThanOrEqual(100);
    // Whole Q4_0 blocks (18 bytes) and whole 4-byte words: chunks of 72 bytes, the last one shorter.
    expect(offsets).toEqual(Array.from({ length: 10 }, (_, i) => i * 72));

    // A chunk too small for a 4-byte-aligned run of blocks still keeps to whole blocks.
    const smallOffsets: number[] = [];
    await streamTensorBytes(source, tensor, 20, (_, offsetInTensor) => {
      smallOffsets.push(offsetInTensor);
    });
    expect(smallOffsets).toEqual(Array.from({ length: 37 }, (_, i) => i * 18));
  });

  it('uses 8 MiB chunks by default and refuses a chunk smaller than one block', async () => {
    const data = randomBytes(4 * 1000, 12);
    const bytes = writeGguf({ metadata: [], tensors: [{ name: 'w', shape: [1000], type: GgmlType.F32, data }] });
    const [tensor] = (await parseGguf(sourceFromBytes(bytes))).tensors;
    const chunks: Uint8Array[] = [];
    await streamTensorBytes(sourceFromBytes(bytes), tensor, undefined, (chunk) => {
      chunks.push(chunk);
    });
    expect(chunks).toEqual([data]);
    await expect(streamTensorBytes(sourceFromBytes(bytes), tensor, 3, () => {})).rejects.toThrow(InvalidRequestError);
  });
});

describe('ByteSources', () => {
  const bytes = writeGguf({ metadata: metadataForEveryValueType(), tensors: tensorsOfSeveralTypes() });

  it('parse the same file from bytes, a Blob, a local path and a URL', async () => {
    const reference = await parseGguf(sourceFromBytes(bytes, 'fixture.gguf'));
    expect(await parseGguf(sourceFromBlob(new Blob([bytes]), 'fixture.gguf'))).toEqual(reference);

    const dir = await mkdtemp(join(tmpdir(), 'longtab-gguf-'));
    try {
      await writeFile(join(dir, 'fixture.gguf'), bytes);
      const fromPath = await sourceFromPath(join(dir, 'fixture.gguf'));
      expect(fromPath.name).toBe('fixture.gguf');
      expect(await parseGguf(fromPath)).toEqual(reference);
      await fromPath.close!();
    } finally {
      await rm(dir, { recursive: true });
    }

    const server = rangeServer(bytes);
    const fromUrl = await sourceFromUrl('https://example.test/models/fixture.gguf', { fetch: server.fetch });
    expect(fromUrl.name).toBe('fixture.gguf');
    expect(fromUrl.size).toBe(bytes.byteLength);
    expect(await parseGguf(fromUrl)).toEqual(reference);
    expect(server.ranges.every((range) => range !== null)).toBe(true);
  });

  it('report a missing local file, and a directory, as request errors naming the path', async () => {
    // A directory opens on Linux and would fail only at its first read, with an untyped EISDIR.
    for (const [fault, path, message] of [
      [
        'a model path with no file (sourceFromPath, as engine.load in Node)',
        '/nonexistent/model.gguf',
        /Cannot open the model file \/nonexistent\/model.gguf: there is no file at that path/,
      ],
      [
        'a directory as the model path (sourceFromPath, as engine.load in Node)',
        '/tmp',
        'Cannot open the model file /tmp: it is a directory.',
      ],
    ] as const) {
      const error = await rejectionOf(sourceFromPath(path));
      log.record({
        area: 'files',
        fault,
        expected: 'InvalidRequestError naming the path, before any read',
        outcome: describeRefusal(error, message),
        ok: isRefusal(error, InvalidRequestError, message),
      });
      expect(error, fault).toBeInstanceOf(InvalidRequestError);
      expect((error as Error).message, fault).toMatch(message);
    }
  });

  it('reject reads past the end as a truncated file', async () => {
    await expect(sourceFromBytes(bytes).read(bytes.byteLength - 2, 4)).rejects.toThrow(CorruptModelFileError);
    await expect(sourceFromBlob(new Blob([bytes])).read(bytes.byteLength, 1)).rejects.toThrow(CorruptModelFileError);
  });

  it('turn HTTP and network failures into DownloadFailedError, and aborts into AbortedError', async () => {
    const url = 'https://example.test/m.gguf';
    const status = (code: number) => async () => new Response('nope', { status: code });
    await expect(sourceFromUrl(url, { fetch: status(404) as typeof fetch })).rejects.toThrow(DownloadFailedError);
    // A server that ignores Range would send the whole file: refused with a message saying why.
    await expect(sourceFromUrl(url, { fetch: status(200) as typeof fetch })).rejects.toThrow(/Range/);
    const offline = (async () => {
      throw new TypeError('fetch failed');
    }) as typeof fetch;
    await expect(sourceFromUrl(url, { fetch: offline })).rejects.toThrow(DownloadFailedError);

    // The probe succeeds, then a read answers 500 or a short body.
    const flaky = rangeServer(bytes);
    const source = await sourceFromUrl(url, { fetch: flaky.fetch });
    flaky.failWith = 500;
    await expect(source.read(0, 16)).rejects.toThrow(DownloadFailedError);
    flaky.failWith = 'short';
    await expect(source.read(0, 16)).rejects.toThrow(DownloadFailedError);
    flaky.failWith = 'shifted';
    await expect(source.read(0, 16)).rejects.toThrow(/mangled/);

    const controller = new AbortController();
    const aborting = (async (_: unknown, init?: RequestInit) => {
      controller.abort();
      throw init?.signal?.reason ?? new Error('aborted');
    }) as typeof fetch;
    await expect(sourceFromUrl(url, { fetch: aborting, signal: controller.signal })).rejects.toThrow(AbortedError);
  });

  it('fall back to HEAD when Content-Range has no total', async () => {
    const fetchWithoutTotal = (async (_: unknown, init?: RequestInit) => {
      if (init?.method === 'HEAD') return new Response(null, { headers: { 'Content-Length': String(bytes.length) } });
      return new Response(bytes.slice(0, 1), { status: 206, headers: { 'Content-Range': 'bytes 0-0/*' } });
    }) as typeof fetch;
    const source = await sourceFromUrl('https://example.test/m.gguf', { fetch: fetchWithoutTotal });
    expect(source.size).toBe(bytes.length);
  });
});

/** A fake HTTP server that honours `Range: bytes=a-b` like a static file host. */
function rangeServer(bytes: Uint8Array) {
  const server = {
    ranges: [] as (string | null)[],
    failWith: null as number | 'short' | 'shifted' | null,
    fetch: (async (_: unknown, init?: RequestInit) => {
      const range = new Headers(init?.headers).get('Range');
      server.ranges.push(range);
      if (typeof server.failWith === 'number') return new Response('error', { status: server.failWith });
      const match = /^bytes=(\d+)-(\d+)$/.exec(range ?? '');
      if (!match) return new Response(bytes.slice(), { status: 200 });
      const start = Number(match[1]) + (server.failWith === 'shifted' ? 1 : 0);
      const end = Math.min(Number(match[2]), bytes.length - 1);
      const body = bytes.slice(start, server.failWith === 'short' ? end : end + 1);
      return new Response(body, { status: 206, headers: { 'Content-Range': `bytes ${start}-${end}/${bytes.length}` } });
    }) as typeof fetch,
  };
  return server;
}
