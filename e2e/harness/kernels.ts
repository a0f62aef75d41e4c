/** Harness page: starts the kernel worker, shows its report and exposes it as `window.kernelReport` for Playwright. */
import type { KernelCheckOutcome, KernelReport, KernelRunRequest } from './kernel-report.ts';

declare global {
  interface Window {
    kernelReport?: KernelReport;
  }
}

const status = document.getElementById('status') as HTMLElement;

function checkPassed(c: KernelCheckOutcome): boolean {
  const withinTolerance = c.maxToleranceRatio <= 1;
  const comparisonOk = c.expect === 'match' ? withinTolerance : c.maxToleranceRatio > 1;
  return !c.error && comparisonOk && c.leakedBuffers === 0 && c.uncapturedErrors.length === 0;
}

function cell(row: HTMLTableRowElement, text: string, className = ''): void {
  const td = row.insertCell();
  td.textContent = text;
  if (className) td.className = className;
}

function render(report: KernelReport): void {
  status.replaceChildren();
  if (!report.ok) {
    const pre = document.createElement('pre');
    pre.className = 'fail';
    pre.textContent = report.error;
    status.append(pre);
  } else {
    const { adapter, features } = report;
    const summary = document.createElement('p');
    summary.textContent =
      `Adapter: ${adapter.description || adapter.vendor || 'unnamed'} (${adapter.architecture || 'unknown architecture'})` +
      `${adapter.isFallbackAdapter ? ', fallback' : ''}; shader-f16 ${features.shaderF16 ? 'yes' : 'no'}, ` +
      `subgroups ${features.subgroups ? 'yes' : 'no'}; live buffers after the run: ${report.allocator.totalBuffers}; ` +
      `uncaptured errors: ${report.uncapturedErrors.length}.`;
    const table = document.createElement('table');
    const head = table.createTHead().insertRow();
    for (const title of ['check', 'expect', 'max error / tolerance', 'elements', 'leaked buffers', 'ms', 'result'])
      cell(head, title);
    const body = table.createTBody();
    for (const c of report.checks) {
      const row = body.insertRow();
      const passed = checkPassed(c);
      cell(row, c.name);
      cell(row, c.expect);
      cell(row, c.error ? c.error : c.maxToleranceRatio.toPrecision(3));
      cell(row, String(c.elements));
      cell(row, String(c.leakedBuffers));
      cell(row, String(c.ms));
      cell(row, passed ? 'pass' : 'FAIL', passed ? 'pass' : 'fail');
    }
    status.append(summary, table);
  }
  status.dataset.state = 'done';
  window.kernelReport = report;
}

function fail(error: string): void {
  render({ ok: false, userAgent: navigator.userAgent, error });
}

const worker = new Worker(new URL('./kernel-worker.ts', import.meta.url), { type: 'module' });
worker.addEventListener('message', (event: MessageEvent<KernelReport>) => render(event.data));
// A worker that fails to load or throws outside the run reports here, not through a message.
worker.addEventListener('error', (event) =>
  fail(`kernel worker failed: ${event.message || 'failed to load the module'}`),
);
worker.addEventListener('messageerror', () => fail('kernel worker sent a message that could not be deserialized'));
const only = new URLSearchParams(location.search).get('only');
worker.postMessage((only ? { only } : {}) satisfies KernelRunRequest);
