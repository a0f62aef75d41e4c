import { defineConfig } from 'vitest/config';

export default defineConfig({
  test: {
    include: ['{app,core,runtime,kernels,workers,tools,bench,test}/**/*.test.ts'],
    pool: 'forks',
    testTimeout: 120_000,
    hookTimeout: 120_000,
    env: { XDG_RUNTIME_DIR: process.env.XDG_RUNTIME_DIR ?? '/tmp' },
  },
});
