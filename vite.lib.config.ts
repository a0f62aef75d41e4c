import { dirname, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';
import { defineConfig } from 'vite';

const root = dirname(fileURLToPath(import.meta.url));

/**
 * Library build (`npm run build:lib`): `createEngine()`, the API types' runtime parts and the typed errors as one ESM
 * module, with the engine worker emitted beside it as its own self-contained module (loaded through
 * `new URL(..., import.meta.url)`, which bundlers and plain `<script type="module">` pages both resolve).
 * Declarations come from `tsc -p tsconfig.lib.json`. Output: dist-lib/ (git-ignored).
 */
export default defineConfig({
  publicDir: false,
  // Relative asset URLs: the worker is found next to longtab.js wherever it is served from.
  base: './',
  worker: { format: 'es' },
  build: {
    outDir: 'dist-lib',
    emptyOutDir: true,
    target: 'es2022',
    sourcemap: true,
    lib: {
      entry: resolve(root, 'workers/index.ts'),
      formats: ['es'],
      fileName: () => 'longtab.js',
    },
  },
});
