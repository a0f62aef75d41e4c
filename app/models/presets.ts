/**
 * GGUF files on the Hugging Face hub that the runtime supports (llama / qwen2 / qwen3 architectures, weight types with
 * kernels). Sizes are APPROXIMATE: they come from stored copies of the hub's listings and memory, and were NOT verified
 * against the hub from this network (it cannot reach the hub). The download checks the real size from
 * Content-Length / Content-Range before it marks a file complete, so a wrong estimate here only affects the label.
 */
export interface ModelPreset {
  id: string;
  label: string;
  repo: string;
  file: string;
  /** Approximate size in bytes (see above). */
  approxBytes: number;
  note: string;
}

const MB = 1_000_000;

export const MODEL_PRESETS: readonly ModelPreset[] = [
  {
    id: 'qwen2.5-0.5b-instruct-q4_k_m',
    label: 'Qwen2.5 0.5B Instruct (Q4_K_M)',
    repo: 'Qwen/Qwen2.5-0.5B-Instruct-GGUF',
    file: 'qwen2.5-0.5b-instruct-q4_k_m.gguf',
    approxBytes: 491 * MB,
    note: 'Small and quick; good first model.',
  },
  {
    id: 'qwen3-0.6b-q8_0',
    label: 'Qwen3 0.6B (Q8_0)',
    repo: 'Qwen/Qwen3-0.6B-GGUF',
    file: 'Qwen3-0.6B-Q8_0.gguf',
    approxBytes: 639 * MB,
    note: 'Qwen3 chat template; 8-bit weights.',
  },
  {
    id: 'smollm2-360m-instruct-q4_k_m',
    label: 'SmolLM2 360M Instruct (Q4_K_M)',
    repo: 'bartowski/SmolLM2-360M-Instruct-GGUF',
    file: 'SmolLM2-360M-Instruct-Q4_K_M.gguf',
    approxBytes: 271 * MB,
    note: 'The smallest instruct preset.',
  },
  {
    id: 'llama-3.2-1b-instruct-q4_k_m',
    label: 'Llama 3.2 1B Instruct (Q4_K_M)',
    repo: 'bartowski/Llama-3.2-1B-Instruct-GGUF',
    file: 'Llama-3.2-1B-Instruct-Q4_K_M.gguf',
    approxBytes: 808 * MB,
    note: 'Largest preset; needs ~1 GB of GPU memory.',
  },
];

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
