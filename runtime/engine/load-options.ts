/**
 * The one check of load options. `parseLoadOptions` turns what a caller passes to `load` (EngineLoadOptions: the
 * public shape, research knobs under `experimental`) into ParsedLoadOptions: each field checked for its type, its
 * range and the combinations it needs, the defaults applied. Defaults that depend on the model or the device stay
 * undefined (ModelRunner.load resolves them; the KV mode with resolveKvMode below). Nothing below checks user input
 * again: ModelRunner.load, kvPoolOptions and the KV pool read the typed object. The pool keeps its invariants and what
 * only the model can tell (which layers exist, which group sizes divide a row, whether a page fits the budget). Pure:
 * no GPU; resolveKvMode reads the model's shape only.
 */
import { InvalidRequestError } from '../../core/errors.ts';
import { DEFAULT_CHUNK_TIMEOUT_MS, DEFAULT_HEADERS_TIMEOUT_MS } from '../../core/remote-file.ts';
import { DEFAULT_PAGE_TOKENS } from '../kv/page-ledger.ts';
import { quantPageLayout } from '../kv/quant-layout.ts';
import {
  type EngineLoadOptions,
  type ExperimentalLoadOptions,
  type KvMode,
  type KvRotation,
  type LoadProgress,
  PREFILL_CHOICES,
  type PrefillAttention,
} from './api-types.ts';
import { checkObject, choiceList, failField } from './validate.ts';

/** Load options, checked and with their defaults: the one shape every consumer below the API reads. */
export interface ParsedLoadOptions {
  /** undefined: int2 where the model allows it, else f16 (resolveKvMode, once the model is known). */
  kv: KvMode | undefined;
  kvBudgetBytes: number;
  hostKvBudgetBytes: number;
  persist: boolean;
  maxSequences: number;
  /** undefined: the model's context length. */
  maxContextTokens: number | undefined;
  /** undefined: defaultPrefillChunk (it depends on the device and the KV budget). */
  prefillChunk: number | undefined;
  /** undefined: defaultRotation of the mode kv resolves to. */
  rotation: KvRotation | undefined;
  calibrate: 'background' | 'off';
  onProgress: ((progress: LoadProgress) => void) | undefined;
  /** URL sources' deadlines (ms): for a response's headers, and for each chunk of its body. */
  headersTimeoutMs: number;
  chunkTimeoutMs: number;
  // ExperimentalLoadOptions, flat: only the public shape sets them apart.
  sink: number;
  window: number;
  /** undefined: min(128, kvHeads × headDim), the pool's default. */
  groupSize: number | undefined;
  codeBits: 1 | 2;
  boostLayers: number[];
  /** int2 with calibrated rotations: the calibration's per-layer plan ('calibrated') or one format ('uniform'). */
  precisionPlan: 'calibrated' | 'uniform';
  prefillMatmul: PrefillAttention;
  prefillAttention: PrefillAttention;
  /** undefined: defaultCalibrationTokens(config). */
  calibrationTokens: number | undefined;
}

/** The defaults that depend on nothing (kv's depends on the model: resolveKvMode; rotation's on kv: defaultRotation). */
export const LOAD_DEFAULTS = {
  kvBudgetBytes: 64 * 1024 * 1024,
  maxSequences: 16,
  calibrate: 'background',
  sink: 64,
  window: 256,
  codeBits: 2,
  prefillMatmul: 'auto',
  prefillAttention: 'auto',
} as const satisfies Partial<ParsedLoadOptions>;

/**
 * The rotation an omitted `rotation` means: int2 uses calibrated rotations where the model has them (its metadata
 * or the rotation cache) and Hadamard until then (LongtabEngine calibrates in the background unless calibrate is
 * 'off'; ModelRunner.load resolves it); f16 stores K/V as they are.
 */
export function defaultRotation(kv: KvMode): KvRotation {
  return kv === 'int2' ? 'calibrated' : 'none';
}

/** What resolveKvMode reads of a model (a ModelConfig is one). */
export interface KvModelShape {
  kvHeads: number;
  headDim: number;
}

/**
 * Why `model` cannot take the 2-bit cache that `options` ask for, or null where it can: each K/V row (kvHeads ×
 * headDim values) must cut into the quant groups of the pool's page layout (runtime/kv/quant-layout.ts, at the
 * group size and code bits given, else the pool's defaults), and the Hadamard rotation int2 defaults to needs a
 * power-of-two head dimension (runtime/kv/rotation.ts).
 */
export function int2Unfit(
  options: Pick<Partial<ParsedLoadOptions>, 'rotation' | 'groupSize' | 'codeBits'>,
  model: KvModelShape,
): string | null {
  const format = { bits: options.codeBits ?? LOAD_DEFAULTS.codeBits, groupSize: options.groupSize };
  try {
    // The pool's own check of the formats, on a one-layer page of the pool's size.
    const { kvHeads, headDim } = model;
    const pageTokens = DEFAULT_PAGE_TOKENS;
    quantPageLayout({ kvHeads, headDim, layers: 1, pageTokens, keyFormat: format, valueFormat: format });
  } catch (error) {
    if (error instanceof InvalidRequestError) return error.message;
    throw error;
  }
  const d = model.headDim;
  // Without stored rotations an omitted rotation runs Hadamard, which needs the power of two too.
  if ((options.rotation ?? 'hadamard') !== 'none' && (d & (d - 1)) !== 0) {
    return `a Hadamard rotation needs a power-of-two head dimension, not ${d}`;
  }
  return null;
}

/**
 * The KV mode of a load: `kv` where the caller passed one, else int2 where the model allows it (int2Unfit), else
 * f16. Boosted layers are a tier of the 2-bit cache: with kv omitted on a model that cannot take it they fail
 * here, naming why, rather than in the f16 pool.
 */
export function resolveKvMode(options: Partial<ParsedLoadOptions>, model: KvModelShape): KvMode {
  if (options.kv !== undefined) return options.kv;
  const unfit = int2Unfit(options, model);
  if (unfit !== null && (options.boostLayers?.length ?? 0) > 0) {
    throw new InvalidRequestError(
      `experimental.boostLayers needs the 2-bit cache, and this model cannot take it (${unfit}); drop boostLayers for an f16 cache.`,
      { field: 'experimental.boostLayers' },
    );
  }
  return unfit === null ? 'int2' : 'f16';
}

// Built from records over the types' keys, so a field added to a type without its check does not compile.
const PUBLIC_FIELDS = Object.keys({
  kv: true,
  kvBudgetBytes: true,
  hostKvBudgetBytes: true,
  persist: true,
  maxSequences: true,
  maxContextTokens: true,
  prefillChunk: true,
  rotation: true,
  calibrate: true,
  onProgress: true,
  network: true,
  experimental: true,
} satisfies Record<keyof EngineLoadOptions, true>);

const NETWORK_FIELDS = Object.keys({
  headersTimeoutMs: true,
  chunkTimeoutMs: true,
} satisfies Record<keyof NonNullable<EngineLoadOptions['network']>, true>);

/** The longest deadline a caller may set: an hour. */
const MAX_TIMEOUT_MS = 3_600_000;

const EXPERIMENTAL_FIELDS = Object.keys({
  sink: true,
  window: true,
  groupSize: true,
  codeBits: true,
  boostLayers: true,
  precisionPlan: true,
  prefillMatmul: true,
  prefillAttention: true,
  calibrationTokens: true,
} satisfies Record<keyof ExperimentalLoadOptions, true>);

const ROTATIONS: readonly KvRotation[] = ['hadamard', 'none', 'calibrated'];

function choice<T extends string, F extends T | undefined>(
  field: string,
  value: unknown,
  choices: readonly T[],
  fallback: F,
): T | F {
  if (value === undefined) return fallback;
  if (!choices.includes(value as T)) failField(field, value, `use ${choiceList(choices)}`);
  return value as T;
}

function integer(field: string, value: unknown, min: number, max = Number.MAX_SAFE_INTEGER): number | undefined {
  if (value === undefined) return undefined;
  if (typeof value !== 'number' || !Number.isInteger(value) || value < min || value > max) {
    failField(
      field,
      value,
      max === Number.MAX_SAFE_INTEGER ? `use an integer >= ${min}` : `use an integer in ${min}..${max}`,
    );
  }
  return value;
}

function flag(field: string, value: unknown): boolean | undefined {
  if (value === undefined) return undefined;
  if (typeof value !== 'boolean') failField(field, value, 'use true or false');
  return value;
}

function layerList(field: string, value: unknown): number[] {
  if (value === undefined) return [];
  // Array.from: the holes of a sparse array become undefined, and fail.
  const layers = Array.isArray(value) ? Array.from(value as unknown[]) : null;
  if (!layers?.every((l): l is number => typeof l === 'number' && Number.isSafeInteger(l) && l >= 0)) {
    failField(field, value, 'use an array of layer indices (integers >= 0)');
  }
  const twice = layers.find((l, i) => layers.indexOf(l) !== i);
  if (twice !== undefined) failField(field, layers, `layer ${twice} is listed twice`);
  return layers;
}

/**
 * Checks `input` (what a caller passed to `load`; undefined or null for the defaults) and resolves it. Throws an
 * InvalidRequestError naming the option (`details.field`, e.g. 'kv' or 'experimental.sink') and what it accepts; an
 * unknown field is one too, with the list of known ones.
 */
export function parseLoadOptions(input: unknown): ParsedLoadOptions {
  const o =
    input === undefined || input === null
      ? {}
      : checkObject('load options', input, PUBLIC_FIELDS, (key) =>
          EXPERIMENTAL_FIELDS.includes(key) ? ` It is experimental: pass it as experimental: { ${key} }.` : '',
        );
  const x =
    o.experimental === undefined ? {} : checkObject('load options experimental', o.experimental, EXPERIMENTAL_FIELDS);
  const network = o.network === undefined ? {} : checkObject('load options network', o.network, NETWORK_FIELDS);
  const kv = choice('kv', o.kv, ['f16', 'int2'], undefined);
  if (x.codeBits !== undefined && x.codeBits !== 1 && x.codeBits !== 2) {
    failField('experimental.codeBits', x.codeBits, 'use 1 or 2');
  }
  if (o.onProgress !== undefined && typeof o.onProgress !== 'function') {
    failField('onProgress', o.onProgress, 'use a function');
  }
  const kvBudgetBytes = integer('kvBudgetBytes', o.kvBudgetBytes, 1) ?? LOAD_DEFAULTS.kvBudgetBytes;
  const parsed: ParsedLoadOptions = {
    kv,
    kvBudgetBytes,
    hostKvBudgetBytes: integer('hostKvBudgetBytes', o.hostKvBudgetBytes, 0) ?? kvBudgetBytes,
    persist: flag('persist', o.persist) ?? false,
    maxSequences: integer('maxSequences', o.maxSequences, 1, 256) ?? LOAD_DEFAULTS.maxSequences,
    maxContextTokens: integer('maxContextTokens', o.maxContextTokens, 1),
    prefillChunk: integer('prefillChunk', o.prefillChunk, 1, 4096),
    // Omitted: defaultRotation of the mode, resolved by ModelRunner.load (which tells an omitted rotation, that falls
    // back to Hadamard, from an explicit 'calibrated', that must find rotations).
    rotation: choice('rotation', o.rotation, ROTATIONS, undefined),
    calibrate: choice('calibrate', o.calibrate, ['background', 'off'], LOAD_DEFAULTS.calibrate),
    onProgress: o.onProgress as ParsedLoadOptions['onProgress'],
    headersTimeoutMs:
      integer('network.headersTimeoutMs', network.headersTimeoutMs, 1, MAX_TIMEOUT_MS) ?? DEFAULT_HEADERS_TIMEOUT_MS,
    chunkTimeoutMs:
      integer('network.chunkTimeoutMs', network.chunkTimeoutMs, 1, MAX_TIMEOUT_MS) ?? DEFAULT_CHUNK_TIMEOUT_MS,
    sink: integer('experimental.sink', x.sink, 0) ?? LOAD_DEFAULTS.sink,
    window: integer('experimental.window', x.window, 0) ?? LOAD_DEFAULTS.window,
    groupSize: integer('experimental.groupSize', x.groupSize, 1, 1 << 16),
    codeBits: (x.codeBits as 1 | 2 | undefined) ?? LOAD_DEFAULTS.codeBits,
    boostLayers: layerList('experimental.boostLayers', x.boostLayers),
    precisionPlan: choice('experimental.precisionPlan', x.precisionPlan, ['calibrated', 'uniform'], 'calibrated'),
    prefillMatmul: choice('experimental.prefillMatmul', x.prefillMatmul, PREFILL_CHOICES, LOAD_DEFAULTS.prefillMatmul),
    prefillAttention: choice(
      'experimental.prefillAttention',
      x.prefillAttention,
      PREFILL_CHOICES,
      LOAD_DEFAULTS.prefillAttention,
    ),
    calibrationTokens: integer('experimental.calibrationTokens', x.calibrationTokens, 16, 4096),
  };
  // Boosted layers are a tier of the 2-bit cache (which layers exist is the pool's check: only the model knows; an
  // omitted kv is int2 where the model allows it, and resolveKvMode fails where it does not).
  if (parsed.boostLayers.length > 0 && (parsed.kv === 'f16' || parsed.codeBits !== 2)) {
    throw new InvalidRequestError(
      `experimental.boostLayers needs kv: 'int2' with 2-bit codes (here kv: ${parsed.kv === undefined ? 'omitted' : `'${parsed.kv}'`}, codeBits: ${parsed.codeBits}); use kv: 'int2' and codeBits 2, or drop boostLayers.`,
      { field: 'experimental.boostLayers' },
    );
  }
  return parsed;
}
