import { defineConfig } from '@playwright/test';

/**
 * Browser tests in Debian's Chromium (never a Playwright-downloaded browser). Without a GPU, Chromium's WebGPU runs
 * on SwiftShader, which needs --enable-unsafe-webgpu; --no-sandbox because CI runs as root. The server is the
 * production build (`--mode e2e` adds the e2e/harness pages) so the tests exercise the bundled module workers.
 */
// Fixed so the server and the test workers agree; LONGTAB_E2E_PORT moves it when two checkouts test at once.
const port = Number(process.env.LONGTAB_E2E_PORT ?? 41731);
const baseURL = `http://127.0.0.1:${port}`;
const isCI = Boolean(process.env.CI);

export default defineConfig({
  testDir: 'e2e',
  testMatch: '**/*.spec.ts',
  outputDir: 'test-results',
  // Two cores and a software GPU: one browser at a time keeps timings sane.
  workers: 1,
  fullyParallel: false,
  forbidOnly: isCI,
  retries: 0,
  timeout: 120_000,
  expect: { timeout: 30_000 },
  reporter: [['list'], ['html', { open: 'never', outputFolder: 'playwright-report' }]],
  use: {
    baseURL,
    browserName: 'chromium',
    headless: true,
    screenshot: 'only-on-failure',
    trace: 'retain-on-failure',
    launchOptions: {
      executablePath: process.env.LONGTAB_CHROMIUM ?? '/usr/bin/chromium',
      args: [
        '--no-sandbox',
        '--enable-unsafe-webgpu',
        '--disable-dev-shm-usage',
        '--disable-background-networking',
        '--disable-component-update',
        '--no-first-run',
        '--disable-sync',
        '--disable-quic',
      ],
    },
  },
  webServer: {
    command: `npx vite build --mode e2e --logLevel warn && npx vite preview --mode e2e --host 127.0.0.1 --port ${port} --strictPort`,
    url: baseURL,
    reuseExistingServer: !isCI,
    timeout: 180_000,
    stdout: 'ignore',
    stderr: 'pipe',
  },
});
