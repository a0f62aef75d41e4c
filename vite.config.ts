import { readdirSync } from 'node:fs';
import { dirname, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';
import react from '@vitejs/plugin-react';
import { defineConfig } from 'vite';

const root = dirname(fileURLToPath(import.meta.url));

/** Browser test pages (`e2e/harness/*.html`): served by `vite` in dev, and built only in `--mode e2e`. */
function harnessPages(): Record<string, string> {
  const dir = resolve(root, 'e2e/harness');
  const pages: Record<string, string> = {};
  for (const file of readdirSync(dir)) {
    if (file.endsWith('.html')) pages[`harness-${file.slice(0, -'.html'.length)}`] = resolve(dir, file);
  }
  return pages;
}

export default defineConfig(({ mode }) => {
  const e2e = mode === 'e2e';
  return {
    plugins: [react()],
    // Module workers with code splitting (the engine worker, the kernel test worker).
    worker: { format: 'es' },
    build: {
      // The e2e build keeps its own folder so it never ships in, or overwrites, the app's dist/.
      outDir: e2e ? 'dist/e2e' : 'dist',
      target: 'es2022',
      rollupOptions: {
        input: { main: resolve(root, 'index.html'), ...(e2e ? harnessPages() : {}) },
      },
    },
  };
});
