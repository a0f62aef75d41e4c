/** Harness page for e2e/worker-api.spec.ts: the library's public surface, reachable from `page.evaluate`. */
import * as errors from '../../core/errors.ts';
import { createEngine } from '../../workers/client.ts';

export interface WorkerApiHarness {
  createEngine: typeof createEngine;
  errors: typeof errors;
}

declare global {
  interface Window {
    harness?: WorkerApiHarness;
  }
}

window.harness = { createEngine, errors };
const status = document.getElementById('status') as HTMLElement;
status.textContent = 'Ready.';
status.dataset.state = 'ready';
