/**
 * GGUF files on the Hugging Face hub that the runtime supports: one chat preset per supported architecture (and SmolLM2,
 * a second llama file, as the smallest). Sizes are APPROXIMATE and were NOT verified against the hub from this network
 * (it cannot reach the hub): each preset's comment says where its repo, file name and size come from. The download
 * checks the real size from Content-Length / Content-Range before it marks a file complete, so a wrong estimate here
 * only affects the label; a wrong repo or file name fails the download with the hub's 404.
 * Mistral-style llama files run too, but have no preset: no stored listing names one, and a 7B file (~4.4 GB) is more
 * than a tab should be offered first.
 */
import { type GpuMemoryEstimate, gpuMemoryEstimate, type ModelShape, scratchBytesEstimate } from './model-fit.ts';

export interface ModelPreset {
  id: string;
  label: string;
  /** The model family (one preset each); several families may share an architecture. */
  family: string;
  /**
   * The file's `general.architecture`: the runtime's forward pass that runs it (one of the runtime's
   * SUPPORTED_ARCHITECTURES, which presets.test.ts checks; the page does not import the runtime's model code).
   */
  architecture: string;
  repo: string;
  file: string;
  /** Approximate size in bytes (see above); the weights take about as much GPU memory. */
  approxBytes: number;
  /** From the model's config (its GGUF header): what its scratch buffers are sized by. */
  shape: ModelShape;
  note: string;
}

const MB = 1_000_000;

export const MODEL_PRESETS: readonly ModelPreset[] = [
  // The Qwen org's own file: repo, name and size from memory of its listing, not a stored one (the stored listing has
  // bartowski/Qwen2.5-0.5B-Instruct-GGUF, whose Q4_K_M is 398 MB).
  {
    id: 'qwen2.5-0.5b-instruct-q4_k_m',
    label: 'Qwen2.5 0.5B Instruct (Q4_K_M)',
    family: 'Qwen2.5',
    architecture: 'qwen2',
    repo: 'Qwen/Qwen2.5-0.5B-Instruct-GGUF',
    file: 'qwen2.5-0.5b-instruct-q4_k_m.gguf',
    approxBytes: 491 * MB,
    shape: { dim: 896, heads: 14, kvHeads: 2, headDim: 64, ffnDim: 4864, vocab: 151936 },
    note: 'Small and quick; good first model.',
  },
  // The Qwen org's own file: from memory of its listing, not a stored one.
  {
    id: 'qwen3-0.6b-q8_0',
    label: 'Qwen3 0.6B (Q8_0)',
    family: 'Qwen3',
    architecture: 'qwen3',
    repo: 'Qwen/Qwen3-0.6B-GGUF',
    file: 'Qwen3-0.6B-Q8_0.gguf',
    approxBytes: 639 * MB,
    shape: { dim: 1024, heads: 16, kvHeads: 8, headDim: 128, ffnDim: 3072, vocab: 151936 },
    note: 'Qwen3 chat template; 8-bit weights.',
  },
  // bartowski's older naming (no author prefix): from memory of the hub's listing, not a stored one.
  {
    id: 'smollm2-360m-instruct-q4_k_m',
    label: 'SmolLM2 360M Instruct (Q4_K_M)',
    family: 'SmolLM2',
    architecture: 'llama',
    repo: 'bartowski/SmolLM2-360M-Instruct-GGUF',
    file: 'SmolLM2-360M-Instruct-Q4_K_M.gguf',
    approxBytes: 271 * MB,
    shape: { dim: 960, heads: 15, kvHeads: 5, headDim: 64, ffnDim: 2560, vocab: 49152 },
    note: 'The smallest instruct preset.',
  },
  // bartowski's older naming: from memory of the hub's listing, not a stored one; the size matches a generated file of
  // the same shape and weight types (802.8 MB, bench/results/2026-11-30-nvidia-h200-session3-final.json).
  {
    id: 'llama-3.2-1b-instruct-q4_k_m',
    label: 'Llama 3.2 1B Instruct (Q4_K_M)',
    family: 'Llama 3.2',
    architecture: 'llama',
    repo: 'bartowski/Llama-3.2-1B-Instruct-GGUF',
    file: 'Llama-3.2-1B-Instruct-Q4_K_M.gguf',
    approxBytes: 808 * MB,
    shape: { dim: 2048, heads: 32, kvHeads: 8, headDim: 64, ffnDim: 8192, vocab: 128256 },
    note: 'Llama 3 chat template; 128K vocabulary.',
  },
  // Repo and file name from the hub's usual layout and bartowski's naming of his newer repos (the author prefixed, as
  // in the stored listing of bartowski/HuggingFaceTB_SmolLM3-3B-GGUF); NOT in a stored listing. Size from memory of
  // the hub's listing (~0.81 GB), unverified.
  {
    id: 'gemma-3-1b-it-q4_k_m',
    label: 'Gemma 3 1B Instruct (Q4_K_M)',
    family: 'Gemma 3',
    architecture: 'gemma3',
    repo: 'bartowski/google_gemma-3-1b-it-GGUF',
    file: 'google_gemma-3-1b-it-Q4_K_M.gguf',
    approxBytes: 806 * MB,
    shape: { dim: 1152, heads: 4, kvHeads: 1, headDim: 256, ffnDim: 6912, vocab: 262144 },
    note: 'Gemma chat template; 5 of 6 layers attend within a 512-token window.',
  },
  // Repo and size (Q4_K_M 1.92 GB) from the stored listing (../shared/docs/peers.md); the file name follows the
  // listing's quant names with bartowski's author-prefixed repo name.
  {
    id: 'smollm3-3b-q4_k_m',
    label: 'SmolLM3 3B (Q4_K_M)',
    family: 'SmolLM3',
    architecture: 'smollm3',
    repo: 'bartowski/HuggingFaceTB_SmolLM3-3B-GGUF',
    file: 'HuggingFaceTB_SmolLM3-3B-Q4_K_M.gguf',
    approxBytes: 1920 * MB,
    shape: { dim: 2048, heads: 16, kvHeads: 4, headDim: 128, ffnDim: 11008, vocab: 128256 },
    note: 'Every 4th layer runs without RoPE.',
  },
  // bartowski's older naming (no author prefix), repo, file name and size (2.39 GB) from memory of the hub's listing,
  // not a stored one.
  {
    id: 'phi-3.5-mini-instruct-q4_k_m',
    label: 'Phi-3.5 mini Instruct (Q4_K_M)',
    family: 'Phi-3',
    architecture: 'phi3',
    repo: 'bartowski/Phi-3.5-mini-instruct-GGUF',
    file: 'Phi-3.5-mini-instruct-Q4_K_M.gguf',
    approxBytes: 2390 * MB,
    shape: { dim: 3072, heads: 32, kvHeads: 32, headDim: 96, ffnDim: 8192, vocab: 32064 },
    note: 'Largest preset; LongRoPE past 4K tokens of context.',
  },
];

/**
 * The GPU memory a preset takes at most on the page: its weights, the KV budget it loads with (Settings, 64 MiB by
 * default), and scratch for the page's prefill chunk. The same sum the fit check weighs (model-fit.ts).
 */
export function presetGpuMemory(preset: ModelPreset, kvBudgetBytes: number): GpuMemoryEstimate {
  return gpuMemoryEstimate(preset.approxBytes, kvBudgetBytes, scratchBytesEstimate(preset.shape));
}

/** The chat model the demo model's notice offers in one step: the small, quick first preset. */
export const CHAT_PRESET: ModelPreset = MODEL_PRESETS[0]!;

/** `<base>/<repo>/resolve/main/<file>`, the hub's download layout (a local test server mimics it). */
export function hubUrl(baseUrl: string, repo: string, file: string): string {
  const base = baseUrl.replace(/\/+$/, '');
  const repoPath = repo.split('/').map(encodeURIComponent).join('/');
  return `${base}/${repoPath}/resolve/main/${encodeURIComponent(file)}`;
}

/**
 * The project's own demo model, shipped in public/models when it has been trained (it may be absent). It is the page's
 * default: a first visit stores it under DEMO_MODEL_ID and loads it (see app/models/use-default-model.ts).
 */
export const DEMO_MODEL_PATH = 'models/longtab-demo.gguf';
export const DEMO_MODEL_ID = 'longtab-demo';
export const DEMO_MODEL_NAME = 'longtab demo model';
