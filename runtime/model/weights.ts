import { CorruptModelFileError, UnsupportedModelError } from '../../core/errors.ts';
import {
  type ByteSource,
  GGML_TYPE_INFO,
  GgmlType,
  type GgufFile,
  type GgufTensorInfo,
  SUPPORTED_WEIGHT_TYPES,
  unsupportedWeightTypeAdvice,
} from '../../core/gguf-types.ts';
import type { GpuContext } from '../../core/gpu/device.ts';
import { NO_ROPE_SCALING, ropeFrequencyDivisors } from '../../kernels/rope.ts';
import { type GpuWeight, releaseWeight, uploadWeight } from '../../kernels/weights.ts';
import { streamTensorBytes } from '../gguf/read-tensor.ts';
import {
  biasTensorName,
  isExpertTensor,
  longRopeFactorTensor,
  type ModelBias,
  type ModelConfig,
  refuseUnsupportedHeads,
} from './config.ts';

export interface LayerWeights {
  attnNorm: GPUBuffer;
  q: GpuWeight;
  k: GpuWeight;
  v: GpuWeight;
  o: GpuWeight;
  qBias?: GPUBuffer;
  kBias?: GPUBuffer;
  vBias?: GPUBuffer;
  oBias?: GPUBuffer;
  gateBias?: GPUBuffer;
  upBias?: GPUBuffer;
  downBias?: GPUBuffer;
  qNorm?: GPUBuffer;
  kNorm?: GPUBuffer;
  /** gemma3: the norms of the attention's and the feed-forward's outputs (ModelConfig.postNorms). */
  attnPostNorm?: GPUBuffer;
  ffnPostNorm?: GPUBuffer;
  ffnNorm: GPUBuffer;
  gate: GpuWeight;
  up: GpuWeight;
  down: GpuWeight;
}

export interface ModelWeights {
  embedding: GpuWeight;
  layers: LayerWeights[];
  outputNorm: GPUBuffer;
  /** The embedding itself when the output is tied. */
  output: GpuWeight;
  outputBias?: GPUBuffer;
  /** f32 [ropeDim/2]: per-pair RoPE angle divisors: Llama 3's rope_freqs and the model's RoPE scaling, or ones. */
  ropeFreqFactors: GPUBuffer;
  /** The sliding-window layers' divisors (ModelConfig.slidingWindow): no context scaling, so ones. */
  localRopeFreqFactors?: GPUBuffer;
}

/** The LayerWeights field of each per-layer bias. */
const LAYER_BIAS_FIELD = {
  q: 'qBias',
  k: 'kBias',
  v: 'vBias',
  o: 'oBias',
  gate: 'gateBias',
  up: 'upBias',
  down: 'downBias',
} as const satisfies Record<Exclude<ModelBias, 'output'>, keyof LayerWeights>;
const LAYER_BIASES = Object.keys(LAYER_BIAS_FIELD) as (keyof typeof LAYER_BIAS_FIELD)[];

/** Expected GGUF shape of every tensor the forward pass reads: metadata that contradicts a tensor is caught here. */
export function expectedTensorShapes(c: ModelConfig): Map<string, number[]> {
  const shapes = new Map<string, number[]>();
  const q = c.heads * c.headDim;
  const kv = c.kvHeads * c.headDim;
  shapes.set('token_embd.weight', [c.dim, c.vocab]);
  shapes.set('output_norm.weight', [c.dim]);
  if (!c.tiedOutput) shapes.set('output.weight', [c.dim, c.vocab]);
  if (c.biases.includes('output')) shapes.set('output.bias', [c.vocab]);
  if (c.ropeFreqFactors) shapes.set('rope_freqs.weight', [c.ropeDim / 2]);
  if (c.longRope?.long) shapes.set('rope_factors_long.weight', [c.ropeDim / 2]);
  if (c.longRope?.short) shapes.set('rope_factors_short.weight', [c.ropeDim / 2]);
  for (let i = 0; i < c.layers; i++) {
    const p = `blk.${i}.`;
    shapes.set(`${p}attn_norm.weight`, [c.dim]);
    if (c.fusedQkv) shapes.set(`${p}attn_qkv.weight`, [c.dim, q + 2 * kv]);
    else {
      shapes.set(`${p}attn_q.weight`, [c.dim, q]);
      shapes.set(`${p}attn_k.weight`, [c.dim, kv]);
      shapes.set(`${p}attn_v.weight`, [c.dim, kv]);
    }
    shapes.set(`${p}attn_output.weight`, [q, c.dim]);
    const biasLength = { q, k: kv, v: kv, o: c.dim, gate: c.ffnDim, up: c.ffnDim, down: c.dim };
    for (const bias of LAYER_BIASES) {
      if (c.biases.includes(bias)) shapes.set(biasTensorName(bias, i), [biasLength[bias]]);
    }
    if (c.qkNorm) {
      shapes.set(`${p}attn_q_norm.weight`, [c.headDim]);
      shapes.set(`${p}attn_k_norm.weight`, [c.headDim]);
    }
    if (c.postNorms) {
      shapes.set(`${p}post_attention_norm.weight`, [c.dim]);
      shapes.set(`${p}post_ffw_norm.weight`, [c.dim]);
    }
    shapes.set(`${p}ffn_norm.weight`, [c.dim]);
    if (c.fusedGateUp) shapes.set(`${p}ffn_up.weight`, [c.dim, 2 * c.ffnDim]);
    else {
      shapes.set(`${p}ffn_gate.weight`, [c.dim, c.ffnDim]);
      shapes.set(`${p}ffn_up.weight`, [c.dim, c.ffnDim]);
    }
    shapes.set(`${p}ffn_down.weight`, [c.ffnDim, c.dim]);
  }
  return shapes;
}

/**
 * Checks presence, shape and type of every tensor before any GPU memory is allocated, and that the forward pass reads
 * every tensor the file has: one it skipped would leave the model answering wrong without a word (llama.cpp refuses
 * such files too). Then that the attention kernels run the model's heads.
 */
export function validateTensors(file: GgufFile, config: ModelConfig): Map<string, GgufTensorInfo> {
  const byName = new Map(file.tensors.map((t) => [t.name, t]));
  const expected = expectedTensorShapes(config);
  for (const t of file.tensors) {
    if (!expected.has(t.name)) {
      throw new UnsupportedModelError(
        isExpertTensor(t.name)
          ? `The model has tensor '${t.name}', a mixture-of-experts tensor; longtab runs dense models only. Pick a dense model of a similar size.`
          : `The model has tensor '${t.name}', which longtab's ${config.architecture} forward pass does not use: it would answer as if the tensor were absent, so it refuses the file.`,
        { tensor: t.name },
      );
    }
  }
  for (const [name, shape] of expected) {
    const tensor = byName.get(name);
    if (!tensor)
      throw new CorruptModelFileError(
        `The model file has no tensor '${name}', which a ${config.architecture} model needs.`,
        { tensor: name },
      );
    const actual = tensor.shape.join('x');
    if (actual !== shape.join('x')) {
      throw new CorruptModelFileError(
        `Tensor '${name}' has shape [${actual}] but the metadata implies [${shape.join('x')}]: the file's metadata contradicts its tensors.`,
        { tensor: name, shape: tensor.shape, expected: shape },
      );
    }
    const isVector = shape.length === 1;
    if (isVector ? tensor.type !== GgmlType.F32 : !SUPPORTED_WEIGHT_TYPES.includes(tensor.type)) {
      throw new UnsupportedModelError(
        `Tensor '${name}' has type ${GGML_TYPE_INFO[tensor.type]?.name ?? tensor.type}, which longtab does not run` +
          (isVector ? ' (norms and biases must be F32).' : `; ${unsupportedWeightTypeAdvice(tensor.type)}.`),
        { tensor: name, type: tensor.type },
      );
    }
  }
  refuseUnsupportedHeads(file.metadata, config);
  return byName;
}

async function uploadVector(gpu: GpuContext, source: ByteSource, tensor: GgufTensorInfo): Promise<GPUBuffer> {
  const buffer = gpu.allocator.createBuffer({
    label: tensor.name,
    category: 'weights',
    size: tensor.byteLength,
    usage: GPUBufferUsage.STORAGE | GPUBufferUsage.COPY_DST,
  });
  await streamTensorBytes(source, tensor, 1 << 20, (bytes, offset) => {
    gpu.device.queue.writeBuffer(buffer, offset, bytes.buffer, bytes.byteOffset, bytes.byteLength);
  });
  return buffer;
}

/** An F32 vector read to the CPU (Llama 3's rope_freqs or a LongRoPE set, which the RoPE scaling multiplies before upload). */
async function readVector(
  source: ByteSource,
  tensor: GgufTensorInfo,
  report: (t: GgufTensorInfo) => void,
): Promise<Float32Array> {
  const bytes = new Uint8Array(tensor.byteLength);
  await streamTensorBytes(source, tensor, 1 << 20, (chunk, offset) => {
    bytes.set(chunk, offset);
  });
  report(tensor);
  return new Float32Array(bytes.buffer);
}

export interface WeightLoadProgress {
  tensorsDone: number;
  tensorsTotal: number;
  bytesDone: number;
  bytesTotal: number;
}

/**
 * Rows `first .. first + count` of a matrix as a tensor of their own: a fused matrix's part (phi3's q, k and v in
 * attn_qkv, its gate and up in ffn_up). GGUF stores a matrix row after row and every weight type quantizes within a
 * row, so the part's bytes are a contiguous range of the whole's, the same values it would have unfused.
 */
function rowRange(t: GgufTensorInfo, part: string, first: number, count: number): GgufTensorInfo {
  const rowBytes = t.byteLength / t.shape[1];
  return {
    ...t,
    name: `${t.name}[${part}]`,
    shape: [t.shape[0], count],
    offset: t.offset + first * rowBytes,
    byteLength: count * rowBytes,
  };
}

/**
 * Streams every tensor to GPU buffers. On failure, every buffer created so far is released before the error
 * propagates, so a failed load leaves no GPU memory behind.
 */
export async function loadModelWeights(
  gpu: GpuContext,
  file: GgufFile,
  source: ByteSource,
  config: ModelConfig,
  onProgress?: (p: WeightLoadProgress) => void,
  /** The most tokens a sequence may reach (the pool's maxSequenceTokens): picks phi3's LongRoPE factors. */
  contextTokens = config.contextLength,
): Promise<ModelWeights> {
  const byName = validateTensors(file, config);
  const created: { buffers: GPUBuffer[]; weights: GpuWeight[] } = { buffers: [], weights: [] };
  const bytesTotal = [...expectedTensorShapes(config).keys()].reduce(
    (sum, n) => sum + (byName.get(n)?.byteLength ?? 0),
    0,
  );
  let bytesDone = 0;
  let tensorsDone = 0;
  const tensorsTotal = expectedTensorShapes(config).size;
  const report = (t: GgufTensorInfo) => {
    bytesDone += t.byteLength;
    tensorsDone += 1;
    onProgress?.({ tensorsDone, tensorsTotal, bytesDone, bytesTotal });
  };
  const vector = async (name: string) => {
    const t = byName.get(name)!;
    const b = await uploadVector(gpu, source, t);
    created.buffers.push(b);
    report(t);
    return b;
  };
  const matrix = async (name: string) => {
    const t = byName.get(name)!;
    const w = await uploadWeight(gpu, t, source);
    created.weights.push(w);
    report(t);
    return w;
  };
  /** A fused matrix as its parts, each `[name, rows]` in the order of its rows. */
  const fused = async (name: string, parts: [string, number][]) => {
    const t = byName.get(name)!;
    const weights: GpuWeight[] = [];
    let first = 0;
    for (const [part, rows] of parts) {
      const w = await uploadWeight(gpu, rowRange(t, part, first, rows), source);
      created.weights.push(w);
      weights.push(w);
      first += rows;
    }
    report(t);
    return weights;
  };
  const qRows = config.heads * config.headDim;
  const kvRows = config.kvHeads * config.headDim;
  try {
    const embedding = await matrix('token_embd.weight');
    const layers: LayerWeights[] = [];
    for (let i = 0; i < config.layers; i++) {
      const p = `blk.${i}.`;
      const attnNorm = await vector(`${p}attn_norm.weight`);
      const [q, k, v] = config.fusedQkv
        ? await fused(`${p}attn_qkv.weight`, [
            ['q', qRows],
            ['k', kvRows],
            ['v', kvRows],
          ])
        : [await matrix(`${p}attn_q.weight`), await matrix(`${p}attn_k.weight`), await matrix(`${p}attn_v.weight`)];
      const o = await matrix(`${p}attn_output.weight`);
      const ffnNorm = await vector(`${p}ffn_norm.weight`);
      const [gate, up] = config.fusedGateUp
        ? await fused(`${p}ffn_up.weight`, [
            ['gate', config.ffnDim],
            ['up', config.ffnDim],
          ])
        : [await matrix(`${p}ffn_gate.weight`), await matrix(`${p}ffn_up.weight`)];
      const down = await matrix(`${p}ffn_down.weight`);
      const layer: LayerWeights = { attnNorm, q, k, v, o, ffnNorm, gate, up, down };
      for (const bias of LAYER_BIASES) {
        if (config.biases.includes(bias)) layer[LAYER_BIAS_FIELD[bias]] = await vector(biasTensorName(bias, i));
      }
      if (config.qkNorm) {
        layer.qNorm = await vector(`${p}attn_q_norm.weight`);
        layer.kNorm = await vector(`${p}attn_k_norm.weight`);
      }
      if (config.postNorms) {
        layer.attnPostNorm = await vector(`${p}post_attention_norm.weight`);
        layer.ffnPostNorm = await vector(`${p}post_ffw_norm.weight`);
      }
      layers.push(layer);
    }
    const outputNorm = await vector('output_norm.weight');
    const output = config.tiedOutput ? embedding : await matrix('output.weight');
    const outputBias = config.biases.includes('output') ? await vector('output.bias') : undefined;
    // Llama 3's rope_freqs, or the LongRoPE set for this context; the other set is read past (counted, not used).
    const factorTensor = config.ropeFreqFactors ? 'rope_freqs.weight' : longRopeFactorTensor(config, contextTokens);
    for (const name of ['rope_factors_long.weight', 'rope_factors_short.weight']) {
      const t = byName.get(name);
      if (t && name !== factorTensor) report(t);
    }
    const ropeFreqFactors = gpu.allocator.createStorage(
      'rope.divisors',
      'weights',
      ropeFrequencyDivisors(
        config.ropeDim,
        config.ropeBase,
        config.ropeScaling,
        factorTensor ? await readVector(source, byName.get(factorTensor)!, report) : undefined,
      ),
    );
    created.buffers.push(ropeFreqFactors);
    const window = config.slidingWindow;
    const localRopeFreqFactors = window
      ? gpu.allocator.createStorage(
          'rope.divisors.local',
          'weights',
          ropeFrequencyDivisors(config.ropeDim, window.ropeBase, NO_ROPE_SCALING),
        )
      : undefined;
    if (localRopeFreqFactors) created.buffers.push(localRopeFreqFactors);
    return { embedding, layers, outputNorm, output, outputBias, ropeFreqFactors, localRopeFreqFactors };
  } catch (error) {
    releaseBuffersAndWeights(gpu, created.buffers, created.weights);
    throw error;
  }
}

function releaseBuffersAndWeights(gpu: GpuContext, buffers: GPUBuffer[], weights: GpuWeight[]): void {
  for (const b of buffers) gpu.allocator.release(b);
  for (const w of weights) releaseWeight(gpu, w);
}

export function releaseModelWeights(gpu: GpuContext, w: ModelWeights): void {
  const buffers = [w.outputNorm, w.ropeFreqFactors];
  if (w.outputBias) buffers.push(w.outputBias);
  if (w.localRopeFreqFactors) buffers.push(w.localRopeFreqFactors);
  const weights = [w.embedding];
  if (w.output !== w.embedding) weights.push(w.output);
  for (const l of w.layers) {
    buffers.push(l.attnNorm, l.ffnNorm);
    for (const field of [
      ...Object.values(LAYER_BIAS_FIELD),
      'qNorm',
      'kNorm',
      'attnPostNorm',
      'ffnPostNorm',
    ] as const) {
      const b = l[field];
      if (b) buffers.push(b);
    }
    weights.push(l.q, l.k, l.v, l.o, l.gate, l.up, l.down);
  }
  releaseBuffersAndWeights(gpu, buffers, weights);
}
