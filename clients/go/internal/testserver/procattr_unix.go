//go:build unix && !linux

package testserver

import "syscall"

// newProcAttr puts the server in its own process group, so kill reaches the engine core process too.
func newProcAttr() *syscall.SysProcAttr { return &syscall.SysProcAttr{Setpgid: true} }
