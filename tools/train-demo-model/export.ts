/**
 * Converts the demo model that train.py wrote (manifest.json + raw little-endian f32 tensor files; the matrices in f16
 * with train.py --weights-dtype f16) and the project's tokenizer (tokenizer.json) into one GGUF file through the
 * project's GGUF writer.
 *
 *   npx tsx tools/train-demo-model/export.ts .train/model/manifest.json tools/train-demo-model/tokenizer.json \
 *       public/models/longtab-demo-q8_0.gguf [q8_0|q4_0|f16|f32]
 *
 * Matrices are stored as Q8_0 (default), F16 or F32; norm weights always F32. train.py trains in llama.cpp's NORMAL
 * RoPE layout, so attn_q/attn_k are written as they are: the Q/K permutation that converting Hugging Face checkpoints
 * needs must not be applied here.
 */
import { readFileSync, writeFileSync } from 'node:fs';
import { dirname, join } from 'node:path';
import { InvalidRequestError } from '../../core/errors.ts';
import { GgmlType } from '../../core/gguf-types.ts';
import { f16ToF32, f32ToF16Bits } from '../../kernels/reference/dequantize.ts';
import { type GgufMetadataEntry, type GgufTensorInput, writeGguf } from '../../runtime/gguf/writer.ts';

interface ManifestTensor {
  name: string;
  /** PyTorch order (rows, cols); ggml_ne is the same bytes in GGUF order. */
  shape: number[];
  ggml_ne: number[];
  dtype: 'f32' | 'f16';
  file: string;
  offset: number;
  nbytes: number;
}

interface Manifest {
  architecture: 'llama';
  name: string;
  hparams: {
    vocab_size: number;
    context_length: number;
    embedding_length: number;
    block_count: number;
    feed_forward_length: number;
    'attention.head_count': number;
    'attention.head_count_kv': number;
    'rope.dimension_count': number;
    'rope.freq_base': number;
    'attention.layer_norm_rms_epsilon': number;
  };
  tensors: ManifestTensor[];
}

interface TokenizerJson {
  model: 'gpt2';
  pre: 'gpt-2';
  tokens: string[];
  token_types: number[];
  merges: string[];
  bos_token_id: number;
  eos_token_id: number;
  eot_token_id: number;
  add_bos_token: boolean;
  chat_template: string;
}

type MatrixType = 'q8_0' | 'q4_0' | 'f16' | 'f32';

/** llama.cpp's quantize_row_q8_0_ref: per 32 values, d = amax / 127 stored as f16, q = round(x / d) as i8. */
export function quantizeQ8_0(values: Float32Array): Uint8Array {
  if (values.length % 32 !== 0) {
    throw new InvalidRequestError(`Q8_0 needs a multiple of 32 values, got ${values.length}.`);
  }
  const out = new Uint8Array((values.length / 32) * 34);
  const view = new DataView(out.buffer);
  for (let b = 0; b < values.length / 32; b++) {
    let amax = 0;
    for (let j = 0; j < 32; j++) amax = Math.max(amax, Math.abs(values[b * 32 + j]!));
    const d = amax / 127;
    const id = d ? 1 / d : 0;
    view.setUint16(b * 34, f32ToF16Bits(d), true);
    for (let j = 0; j < 32; j++) {
      const x = values[b * 32 + j]! * Math.fround(id);
      // roundf: half away from zero
      view.setInt8(b * 34 + 2 + j, Math.sign(x) * Math.round(Math.abs(x)));
    }
  }
  return out;
}

/**
 * llama.cpp's quantize_row_q4_0_ref: per 32 values, d = (the value of largest magnitude) / −8 stored as f16, and
 * q = min(15, trunc(x / d + 8.5)); value j in the low nibble of byte j, value 16 + j in its high nibble.
 */
export function quantizeQ4_0(values: Float32Array): Uint8Array {
  if (values.length % 32 !== 0) {
    throw new InvalidRequestError(`Q4_0 needs a multiple of 32 values, got ${values.length}.`);
  }
  const out = new Uint8Array((values.length / 32) * 18);
  const view = new DataView(out.buffer);
  for (let b = 0; b < values.length / 32; b++) {
    let amax = 0;
    let max = 0;
    for (let j = 0; j < 32; j++) {
      const v = values[b * 32 + j]!;
      if (amax < Math.abs(v)) {
        amax = Math.abs(v);
        max = v;
      }
    }
    const d = Math.fround(max / -8);
    const id = d ? Math.fround(1 / d) : 0;
    view.setUint16(b * 18, f32ToF16Bits(d), true);
    const code = (x: number) => Math.min(15, Math.trunc(Math.fround(Math.fround(x * id) + 8.5)));
    for (let j = 0; j < 16; j++) {
      out[b * 18 + 2 + j] = code(values[b * 32 + j]!) | (code(values[b * 32 + 16 + j]!) << 4);
    }
  }
  return out;
}

function toF16(values: Float32Array): Uint8Array {
  const out = new Uint8Array(values.length * 2);
  const view = new DataView(out.buffer);
  for (let i = 0; i < values.length; i++) view.setUint16(i * 2, f32ToF16Bits(values[i]!), true);
  return out;
}

function readTensor(base: string, t: ManifestTensor): Float32Array {
  const bytes = readFileSync(join(base, t.file)).subarray(t.offset, t.offset + t.nbytes);
  const count = t.shape.reduce((a, b) => a * b, 1);
  const width = { f32: 4, f16: 2 }[t.dtype];
  if (width === undefined || bytes.byteLength !== count * width) {
    throw new InvalidRequestError(`Tensor ${t.name}: expected ${count} ${t.dtype} values in ${t.file}@${t.offset}.`);
  }
  const out = new Float32Array(count);
  const view = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
  if (width === 2) for (let i = 0; i < count; i++) out[i] = f16ToF32(view.getUint16(i * 2, true));
  else for (let i = 0; i < count; i++) out[i] = view.getFloat32(i * 4, true);
  return out;
}

export function buildDemoGguf(manifestPath: string, tokenizerPath: string, matrixType: MatrixType): Uint8Array {
  const manifest = JSON.parse(readFileSync(manifestPath, 'utf8')) as Manifest;
  const tok = JSON.parse(readFileSync(tokenizerPath, 'utf8')) as TokenizerJson;
  const hp = manifest.hparams;
  if (tok.tokens.length !== hp.vocab_size) {
    throw new InvalidRequestError(`tokenizer has ${tok.tokens.length} tokens, the model ${hp.vocab_size}.`);
  }
  const base = dirname(manifestPath);
  const tensors: GgufTensorInput[] = manifest.tensors.map((t) => {
    const values = readTensor(base, t);
    if (t.shape.length === 1 || matrixType === 'f32') {
      return { name: t.name, shape: t.ggml_ne, type: GgmlType.F32, data: new Uint8Array(values.buffer) };
    }
    if (matrixType === 'f16') return { name: t.name, shape: t.ggml_ne, type: GgmlType.F16, data: toF16(values) };
    if (matrixType === 'q4_0')
      return { name: t.name, shape: t.ggml_ne, type: GgmlType.Q4_0, data: quantizeQ4_0(values) };
    return { name: t.name, shape: t.ggml_ne, type: GgmlType.Q8_0, data: quantizeQ8_0(values) };
  });
  const u32 = (key: string, value: number): GgufMetadataEntry => ({ key, value, type: 'u32' });
  const f32 = (key: string, value: number): GgufMetadataEntry => ({ key, value, type: 'f32' });
  // llama_ftype: 0 ALL_F32, 1 MOSTLY_F16, 2 MOSTLY_Q4_0, 7 MOSTLY_Q8_0
  const fileType = { f32: 0, f16: 1, q4_0: 2, q8_0: 7 }[matrixType];
  const metadata: GgufMetadataEntry[] = [
    { key: 'general.architecture', value: 'llama' },
    { key: 'general.name', value: manifest.name },
    { key: 'general.license', value: 'MIT' },
    u32('general.file_type', fileType),
    u32('general.quantization_version', 2),
    u32('llama.vocab_size', hp.vocab_size),
    u32('llama.context_length', hp.context_length),
    u32('llama.embedding_length', hp.embedding_length),
    u32('llama.block_count', hp.block_count),
    u32('llama.feed_forward_length', hp.feed_forward_length),
    u32('llama.attention.head_count', hp['attention.head_count']),
    u32('llama.attention.head_count_kv', hp['attention.head_count_kv']),
    u32('llama.rope.dimension_count', hp['rope.dimension_count']),
    f32('llama.rope.freq_base', hp['rope.freq_base']),
    f32('llama.attention.layer_norm_rms_epsilon', hp['attention.layer_norm_rms_epsilon']),
    { key: 'tokenizer.ggml.model', value: tok.model },
    { key: 'tokenizer.ggml.pre', value: tok.pre },
    { key: 'tokenizer.ggml.tokens', value: tok.tokens, type: 'string[]' },
    { key: 'tokenizer.ggml.token_type', value: tok.token_types, type: 'i32[]' },
    { key: 'tokenizer.ggml.merges', value: tok.merges, type: 'string[]' },
    u32('tokenizer.ggml.bos_token_id', tok.bos_token_id),
    u32('tokenizer.ggml.eos_token_id', tok.eos_token_id),
    u32('tokenizer.ggml.eot_token_id', tok.eot_token_id),
    { key: 'tokenizer.ggml.add_bos_token', value: tok.add_bos_token },
    { key: 'tokenizer.ggml.add_eos_token', value: false },
    { key: 'tokenizer.chat_template', value: tok.chat_template },
  ];
  return writeGguf({ metadata, tensors });
}

function main(argv: string[]): void {
  const [manifestPath, tokenizerPath, outPath, type = 'q8_0'] = argv;
  if (!manifestPath || !tokenizerPath || !outPath || !['q8_0', 'q4_0', 'f16', 'f32'].includes(type)) {
    throw new InvalidRequestError(
      'usage: export.ts MANIFEST.json TOKENIZER.json OUT.gguf [q8_0|f16|f32] (see tools/train-demo-model/README.md)',
    );
  }
  const file = buildDemoGguf(manifestPath, tokenizerPath, type as MatrixType);
  writeFileSync(outPath, file);
  console.log(`${outPath}: ${(file.byteLength / 1e6).toFixed(2)} MB (${type})`);
}

if (import.meta.url === `file://${process.argv[1]}`) main(process.argv.slice(2));
